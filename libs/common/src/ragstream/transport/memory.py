"""The in-memory transport: one process's workers chunk, embed and index each announced document."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from ragstream.failures import StageRetry, classify, record_failure, record_retry
from ragstream.messages import DocumentChanged, DocumentDeleted, IndexOutcome
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.documents import DocumentStore, StaleChunkingError
from ragstream.storage.spaces import RetiredSpaceError
from ragstream.transport.base import OnSettled, Settled

__all__ = ["MemoryTransport"]

_Message = DocumentChanged | DocumentDeleted | None


@dataclass(slots=True)
class _Attempt:
    """Where the current attempt at a document is: the step a failure is recorded at."""

    step: str = "chunk"
    chunk_count: int = 0


class _QueueDelivery:
    """Announcements go onto a bounded queue that the workers drain, so a huge folder is not staged
    faster than it can be embedded."""

    def __init__(self, queue: asyncio.Queue[_Message], settled: Settled) -> None:
        self._queue = queue
        self._settled = settled

    async def changed(self, message: DocumentChanged) -> None:
        await self._queue.put(message)

    async def deleted(self, message: DocumentDeleted) -> None:
        await self._queue.put(message)

    async def settle(self) -> Settled:
        await self._queue.join()
        return replace(self._settled)


class MemoryTransport:
    """Workers that run each document through chunk, embed and index in this process.

    Every failure is per document: a transient one (provider down, throttled) is retried by
    ``retry`` (each retry counted on the document), and a document that still fails is recorded in
    ``document_failures`` with its step and reason while the other documents go on. The workers run
    in a task group with the ``open`` block: if one dies (PostgreSQL gone), the block is cancelled
    instead of waiting forever on a full queue, and the error reaches the caller."""

    def __init__(
        self,
        store: DocumentStore,
        chunker: ChunkService,
        embedder: EmbedService,
        indexer: IndexService,
        *,
        workers: int = 4,
        retry: StageRetry | None = None,
    ) -> None:
        self._store = store
        self._chunker = chunker
        self._embedder = embedder
        self._indexer = indexer
        self._workers = workers
        self._retry = retry or StageRetry()

    @asynccontextmanager
    async def open(self, on_settled: OnSettled) -> AsyncIterator[_QueueDelivery]:
        queue: asyncio.Queue[_Message] = asyncio.Queue(maxsize=self._workers * 4)
        settled = Settled()
        async with asyncio.TaskGroup() as group:
            for _ in range(self._workers):
                group.create_task(self._work(queue, settled, on_settled))
            yield _QueueDelivery(queue, settled)
            for _ in range(self._workers):
                await queue.put(None)

    async def _work(self, queue: asyncio.Queue[_Message], settled: Settled, on_settled: OnSettled) -> None:
        while (message := await queue.get()) is not None:
            if isinstance(message, DocumentDeleted):
                if (await self._indexer.delete(message)).outcome is IndexOutcome.DELETED:
                    settled.deleted += 1
            elif await self._index(message, settled):
                settled.indexed += 1
            else:
                settled.failed += 1
            queue.task_done()
            on_settled(replace(settled))

    async def _index(self, message: DocumentChanged, settled: Settled) -> bool:
        """Chunk, embed and commit one document, retrying it whole on a transient failure; its chunks
        count as embedded or not for the guard once it has indexed or run out of attempts.

        Chunked just before a re-chunk switch and committed just after, a document is refused
        (``StaleChunkingError``): it is chunked again at once with the config now active. Likewise
        embedded just before a re-index switched its connection's model (``RetiredSpaceError``): it
        is embedded again at once with the model now effective."""
        try:
            return await self._index_once(message, settled)
        except (StaleChunkingError, RetiredSpaceError) as error:
            if isinstance(error, RetiredSpaceError):
                self._embedder.invalidate()
            return await self._index_once(message, settled, last_try=True)

    async def _index_once(self, message: DocumentChanged, settled: Settled, *, last_try: bool = False) -> bool:
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
                    settled.chunks += indexed.chunk_count

        async def retrying(error: Exception) -> None:
            await record_retry(self._store, message.header, attempt.step, error)

        try:
            await self._retry.run(run, retrying)
            settled.vectors += attempt.chunk_count
            return True
        except Exception as error:  # one document's failure must not stop the others; it is recorded
            if isinstance(error, (StaleChunkingError, RetiredSpaceError)) and not last_try:
                raise
            if attempt.step == "embed":
                settled.missing_vectors += attempt.chunk_count
            await record_failure(self._store, message.header, attempt.step, classify(error))
        return False
