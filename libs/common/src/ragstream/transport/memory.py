"""The in-memory transport: one process's workers chunk, embed and index each announced document."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

from ragstream.failures import StageRetry, classify, record_failure, record_retry
from ragstream.messages import DocumentChanged, DocumentDeleted, IndexOutcome
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.documents import DocumentStore
from ragstream.transport.base import OnSettled, Settled
from ragstream.transport.document import STALE_ERRORS, DocumentAttempt, DocumentRun

__all__ = ["MemoryTransport"]

logger = logging.getLogger(__name__)

_Message = DocumentChanged | DocumentDeleted | None


class _ModelWarmUp:
    """Starts loading a connection's model when its first changed document is announced, in the
    transport's task group: the load overlaps listing, parsing and chunking instead of following them.
    An unchanged sync announces nothing and loads no model. A load that fails is only logged: the
    connection's first embed loads again and records the error on its document."""

    def __init__(self, embed: EmbedService, group: asyncio.TaskGroup) -> None:
        self._embed = embed
        self._group = group
        self._started: set[str] = set()

    def changed(self, connection_id: str) -> None:
        if connection_id not in self._started:
            self._started.add(connection_id)
            self._group.create_task(self._load(connection_id))

    async def _load(self, connection_id: str) -> None:
        try:
            await self._embed.warm_up(connection_id)
        except Exception:
            logger.warning("loading the model of connection %s ahead failed", connection_id, exc_info=True)


class _QueueDelivery:
    """Announcements go onto a bounded queue that the workers drain, so a huge folder is not staged
    faster than it can be embedded."""

    def __init__(self, queue: asyncio.Queue[_Message], settled: Settled, on_changed: Callable[[str], None]) -> None:
        self._queue = queue
        self._settled = settled
        self._on_changed = on_changed

    async def changed(self, message: DocumentChanged) -> None:
        self._on_changed(message.header.connection_id)
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
        self._indexer = indexer
        self._embed = embedder
        self._document = DocumentRun(chunker, embedder, indexer)
        self._workers = workers
        self._retry = retry or StageRetry()

    @asynccontextmanager
    async def open(self, on_settled: OnSettled) -> AsyncIterator[_QueueDelivery]:
        queue: asyncio.Queue[_Message] = asyncio.Queue(maxsize=self._workers * 4)
        settled = Settled()
        async with asyncio.TaskGroup() as group:
            for _ in range(self._workers):
                group.create_task(self._work(queue, settled, on_settled))
            yield _QueueDelivery(queue, settled, _ModelWarmUp(self._embed, group).changed)
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
        """Chunk, embed and commit one document, retrying it whole on a transient failure and once
        more at once when a switch refused it as stale (see ``DocumentRun``); its chunks count as
        embedded or not for the guard once it has indexed or run out of attempts."""
        attempt = DocumentAttempt()
        refused: BaseException | None = None

        async def run() -> None:
            if refused is None:
                committed = await self._document.run(message, attempt)
            else:
                committed = await self._document.rerun(message, refused, attempt)
            settled.chunks += sum(indexed.chunk_count for indexed in committed)

        async def retrying(error: Exception) -> None:
            await record_retry(self._store, message.header, attempt.step, error)

        while True:
            try:
                await self._retry.run(run, retrying)
                settled.vectors += attempt.chunk_count
                return True
            except STALE_ERRORS as error:
                if refused is not None:
                    return await self._failed(message, attempt, settled, error)
                refused = error
            except Exception as error:  # one document's failure must not stop the others; it is recorded
                return await self._failed(message, attempt, settled, error)

    async def _failed(
        self, message: DocumentChanged, attempt: DocumentAttempt, settled: Settled, error: Exception
    ) -> bool:
        if attempt.step == "embed":
            settled.missing_vectors += attempt.chunk_count
        await record_failure(self._store, message.header, attempt.step, classify(error))
        return False
