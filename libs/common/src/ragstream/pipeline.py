"""The embedded runner: every stage in one process, wired by asyncio queues instead of Kafka topics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ragstream.connectors.base import Connector
from ragstream.degradation import EmbeddingDegraded, EmbeddingGuard
from ragstream.failures import StageRetry, classify, record_failure, record_retry
from ragstream.messages import DocumentChanged, DocumentDeleted, IndexOutcome
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.fetch import ChangeSink, FetchService, SyncCounts
from ragstream.stages.index import IndexService
from ragstream.stages.replay import ReplayCounts, ReplayService
from ragstream.storage.cursors import Direction
from ragstream.storage.documents import DocumentStore, Failure, StaleChunkingError
from ragstream.storage.spaces import RetiredSpaceError

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
    # Entries the connector left out, by reason (a symlink, a special file): never indexed.
    skipped: dict[str, int] = field(default_factory=dict)
    listing_done: bool = False
    # Which walk this sync is (backward: the first, full one), and whether it resumed a stopped one.
    direction: Direction | None = None
    resumed: bool = False
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


@dataclass(slots=True)
class _Attempt:
    """Where the current attempt at a document is: the step a failure is recorded at."""

    step: str = "chunk"
    chunk_count: int = 0


class _QueueSink:
    """Changes go to the workers at once; deletions wait until every change is indexed or failed, so a
    sync stopped by the embedding guard deletes nothing."""

    def __init__(self, queue: asyncio.Queue[DocumentChanged | DocumentDeleted | None]) -> None:
        self._queue = queue
        self.deletions: list[DocumentDeleted] = []

    async def changed(self, message: DocumentChanged) -> None:
        await self._queue.put(message)

    async def deleted(self, message: DocumentDeleted) -> None:
        self.deletions.append(message)


class EmbeddedPipeline:
    """Runs a sync to the end: fetch announces changes, workers chunk, embed and index each document.

    Both sides keep a cursor (``sync_cursors``): the fetch's ``download`` walk and the workers' ``index``
    walk, which completes only once everything announced is indexed or failed. A sync that stops
    before that leaves the index walk unfinished, and the next sync announces what is staged but not
    indexed again from the staging store instead of downloading it again.

    Every failure is per document: a transient one (provider down, throttled) is retried by
    ``retry``, each retry counted on the document, and a document that still fails is recorded in
    ``document_failures`` with its step and reason while the other documents go on, unless the
    embedding service degrades: once more than
    ``max_unembedded_ratio`` of the chunks come back without a vector, the sync raises
    ``EmbeddingDegraded``. The queue is bounded so a huge folder is not staged faster than it can be
    embedded.
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
        max_unembedded_ratio: float = 0.8,
        guard_min_chunks: int = 20,
        retry: StageRetry | None = None,
    ) -> None:
        self._store = store
        self._chunker = chunker
        self._embedder = embedder
        self._indexer = indexer
        self._max_bytes = max_document_bytes
        self._workers = workers
        self._max_unembedded_ratio = max_unembedded_ratio
        self._guard_min_chunks = guard_min_chunks
        self._retry = retry or StageRetry()

    async def sync(self, connector: Connector, on_progress: Callable[[SyncProgress], None] | None = None) -> SyncReport:
        progress = SyncProgress()
        notify = on_progress or (lambda _: None)

        async def listed(counts: SyncCounts) -> None:
            progress.listed, progress.unchanged, progress.changed = counts.seen, counts.unchanged, counts.changed
            progress.failed_fetching = counts.failed
            progress.direction, progress.resumed = counts.direction, counts.resumed
            notify(progress)

        connection_id = connector.connection_id
        cursors = self._store.cursors
        fetch = FetchService(self._store, connector, max_document_bytes=self._max_bytes, on_item=listed)
        await fetch.register()
        # The index walk has no position: its workers finish documents in any order, and what matters
        # is only whether it completed (else the next sync announces what is staged again).
        index_walk = await cursors.begin(connection_id, "index")

        async def announce(sink: ChangeSink) -> SyncCounts:
            counts = await fetch.run(sink, index_unfinished=index_walk.resumed)
            # Also when nothing was listed (an empty folder), which the per-item callback never sees.
            progress.direction, progress.resumed = counts.direction, counts.resumed
            progress.skipped = counts.skipped
            return counts

        guard = EmbeddingGuard(self._max_unembedded_ratio, self._guard_min_chunks)
        await self._drive(announce, progress, notify, guard)
        await cursors.complete(connection_id, "index", progress.indexed)
        return SyncReport(connection_id, progress, await self._store.failures(connection_id))

    async def replay(
        self, connection_id: str | None = None, on_progress: Callable[[SyncProgress], None] | None = None
    ) -> tuple[ReplayCounts, SyncProgress]:
        """Re-drive the failed documents (of one connection, or all) through chunk, embed and index.

        A replay carries only failures, so many failing again just means the cause persists: its
        guard never trips, and the report says how many failed again."""
        progress = SyncProgress()
        replay = ReplayService(self._store)
        counts = await self._drive(
            lambda sink: replay.failures(sink, connection_id),
            progress,
            on_progress or (lambda _: None),
            EmbeddingGuard(max_failed_ratio=1.0),
        )
        return counts, progress

    async def _drive(
        self,
        announce: Callable[[ChangeSink], Awaitable[_Counts]],
        progress: SyncProgress,
        notify: Callable[[SyncProgress], None],
        guard: EmbeddingGuard,
    ) -> _Counts:
        """Run ``announce`` into a bounded queue that the workers drain; deletions go last."""
        queue: asyncio.Queue[DocumentChanged | DocumentDeleted | None] = asyncio.Queue(maxsize=self._workers * 4)
        sink = _QueueSink(queue)
        # A task group: if a worker dies (PostgreSQL gone), the listing stops too instead of
        # waiting forever on a full queue, and the error reaches the caller.
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self._workers):
                    group.create_task(self._work(queue, progress, notify, guard))
                counts = await announce(sink)
                progress.listing_done = True
                await queue.join()
                guard.check(final=True)
                for deletion in sink.deletions:
                    await queue.put(deletion)
                for _ in range(self._workers):
                    await queue.put(None)
        except* EmbeddingDegraded as degraded:
            raise degraded.exceptions[0] from None
        notify(progress)
        return counts

    async def _work(
        self,
        queue: asyncio.Queue[DocumentChanged | DocumentDeleted | None],
        progress: SyncProgress,
        notify: Callable[[SyncProgress], None],
        guard: EmbeddingGuard,
    ) -> None:
        while (message := await queue.get()) is not None:
            if isinstance(message, DocumentDeleted):
                if (await self._indexer.delete(message)).outcome is IndexOutcome.DELETED:
                    progress.deleted += 1
            elif await self._index(message, progress, guard):
                progress.indexed += 1
            else:
                progress.failed_processing += 1
            notify(progress)
            queue.task_done()
            guard.check()

    async def _index(self, message: DocumentChanged, progress: SyncProgress, guard: EmbeddingGuard) -> bool:
        """Chunk, embed and commit one document, retrying it whole on a transient failure; its chunks
        count as embedded or not for the guard once it has indexed or run out of attempts.

        Chunked just before a re-chunk switch and committed just after, a document is refused
        (``StaleChunkingError``): it is chunked again at once with the config now active. Likewise
        embedded just before a re-index switched its connection's model (``RetiredSpaceError``): it
        is embedded again at once with the model now effective."""
        try:
            return await self._index_once(message, progress, guard)
        except (StaleChunkingError, RetiredSpaceError) as error:
            if isinstance(error, RetiredSpaceError):
                self._embedder.invalidate()
            return await self._index_once(message, progress, guard, last_try=True)

    async def _index_once(
        self, message: DocumentChanged, progress: SyncProgress, guard: EmbeddingGuard, *, last_try: bool = False
    ) -> bool:
        attempt = _Attempt()

        async def run() -> None:
            attempt.step, attempt.chunk_count = "chunk", 0
            batches = await self._chunker.run(message)
            attempt.chunk_count = sum(len(batch.chunks) for batch in batches)
            for batch in batches:
                attempt.step = "embed"
                embedded = await self._embedder.run(batch)
                attempt.step = "index"
                indexed = await self._indexer.run(embedded)
                if indexed is not None:
                    progress.chunks += indexed.chunk_count

        async def retrying(error: Exception) -> None:
            await record_retry(self._store, message.header, attempt.step, error)

        try:
            await self._retry.run(run, retrying)
            guard.record(embedded=attempt.chunk_count)
            return True
        except Exception as error:  # one document's failure must not stop the sync; it is recorded
            if isinstance(error, (StaleChunkingError, RetiredSpaceError)) and not last_try:
                raise
            if attempt.step == "embed":
                guard.record(failed=attempt.chunk_count)
            await record_failure(self._store, message.header, attempt.step, classify(error))
        return False
