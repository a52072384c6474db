"""The embedded runner: every stage in one process, wired by asyncio queues instead of Kafka topics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ragstream.connectors.base import Connector
from ragstream.failures import classify, record_failure
from ragstream.messages import DocumentChanged, DocumentDeleted, IndexOutcome
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.fetch import ChangeSink, FetchService, SyncCounts
from ragstream.stages.index import IndexService
from ragstream.stages.replay import ReplayCounts, ReplayService
from ragstream.storage.documents import DocumentStore, Failure

__all__ = ["EmbeddedPipeline", "SyncProgress", "SyncReport"]

_Counts = TypeVar("_Counts", SyncCounts, ReplayCounts)


@dataclass(slots=True)
class SyncProgress:
    """A snapshot for progress bars and the API: what is known, what is done, how fast."""

    listed: int = 0
    unchanged: int = 0
    changed: int = 0
    indexed: int = 0
    deleted: int = 0
    failed_fetching: int = 0
    failed_processing: int = 0
    chunks: int = 0
    listing_done: bool = False
    started_at: float = field(default_factory=time.monotonic)

    @property
    def failed(self) -> int:
        return self.failed_fetching + self.failed_processing

    @property
    def done(self) -> int:
        return self.unchanged + self.indexed + self.failed

    @property
    def rate(self) -> float:
        """Documents per second over the sync so far."""
        elapsed = time.monotonic() - self.started_at
        return (self.indexed + self.failed) / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True, slots=True)
class SyncReport:
    connection_id: str
    progress: SyncProgress
    failures: list[Failure]

    @property
    def ok(self) -> bool:
        return not self.failures


class _QueueSink:
    def __init__(self, queue: asyncio.Queue[DocumentChanged | DocumentDeleted | None]) -> None:
        self._queue = queue

    async def changed(self, message: DocumentChanged) -> None:
        await self._queue.put(message)

    async def deleted(self, message: DocumentDeleted) -> None:
        await self._queue.put(message)


class EmbeddedPipeline:
    """Runs a sync to the end: fetch announces changes, workers chunk, embed and index each document.

    Every failure is per document: it is recorded in ``document_failures`` with its step and reason
    and the other documents go on. The queue is bounded so a huge folder is not staged faster than
    it can be embedded.
    """

    def __init__(
        self,
        store: DocumentStore,
        chunker: ChunkService,
        embedder: EmbedService,
        indexer: IndexService,
        *,
        max_document_bytes: int,
        workers: int = 4,
    ) -> None:
        self._store = store
        self._chunker = chunker
        self._embedder = embedder
        self._indexer = indexer
        self._max_bytes = max_document_bytes
        self._workers = workers

    async def sync(self, connector: Connector, on_progress: Callable[[SyncProgress], None] | None = None) -> SyncReport:
        progress = SyncProgress()
        notify = on_progress or (lambda _: None)

        async def listed(counts: SyncCounts) -> None:
            progress.listed, progress.unchanged, progress.changed = counts.seen, counts.unchanged, counts.changed
            progress.failed_fetching = counts.failed
            notify(progress)

        fetch = FetchService(self._store, connector, max_document_bytes=self._max_bytes, on_item=listed)
        await self._drive(fetch.run, progress, notify)
        return SyncReport(connector.connection_id, progress, await self._store.failures(connector.connection_id))

    async def replay(
        self, connection_id: str | None = None, on_progress: Callable[[SyncProgress], None] | None = None
    ) -> tuple[ReplayCounts, SyncProgress]:
        """Re-drive the failed documents (of one connection, or all) through chunk, embed and index."""
        progress = SyncProgress()
        replay = ReplayService(self._store)
        counts = await self._drive(
            lambda sink: replay.failures(sink, connection_id), progress, on_progress or (lambda _: None)
        )
        return counts, progress

    async def _drive(
        self,
        announce: Callable[[ChangeSink], Awaitable[_Counts]],
        progress: SyncProgress,
        notify: Callable[[SyncProgress], None],
    ) -> _Counts:
        """Run ``announce`` into a bounded queue that the workers drain, until both are done."""
        queue: asyncio.Queue[DocumentChanged | DocumentDeleted | None] = asyncio.Queue(maxsize=self._workers * 4)
        # A task group: if a worker dies (PostgreSQL gone), the listing stops too instead of
        # waiting forever on a full queue, and the error reaches the caller.
        async with asyncio.TaskGroup() as group:
            for _ in range(self._workers):
                group.create_task(self._work(queue, progress, notify))
            counts = await announce(_QueueSink(queue))
            progress.listing_done = True
            for _ in range(self._workers):
                await queue.put(None)
        notify(progress)
        return counts

    async def _work(
        self,
        queue: asyncio.Queue[DocumentChanged | DocumentDeleted | None],
        progress: SyncProgress,
        notify: Callable[[SyncProgress], None],
    ) -> None:
        while (message := await queue.get()) is not None:
            if isinstance(message, DocumentDeleted):
                if (await self._indexer.delete(message)).outcome is IndexOutcome.DELETED:
                    progress.deleted += 1
            elif await self._index(message, progress):
                progress.indexed += 1
            else:
                progress.failed_processing += 1
            notify(progress)

    async def _index(self, message: DocumentChanged, progress: SyncProgress) -> bool:
        step = "chunk"
        try:
            for batch in await self._chunker.run(message):
                step = "embed"
                embedded = await self._embedder.run(batch)
                step = "index"
                indexed = await self._indexer.run(embedded)
                if indexed is not None:
                    progress.chunks += indexed.chunk_count
            return True
        except Exception as error:  # one document's failure must not stop the sync; it is recorded
            await record_failure(self._store, message.header, step, classify(error))
        return False
