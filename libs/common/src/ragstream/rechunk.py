"""Re-chunk without downtime: rebuild one connection's chunks with a new chunking config, then switch.

Search keeps reading the connection's active index version while the next one is filled, document
by document, from the committed staged content, chunked with the new config and embedded in the
connection's embedding space. Ingest keeps committing with the old config meanwhile; an edited document
loses its new-version chunks and is rebuilt again from its new content. The switch
(``RechunkStore.switch``) rebuilds the last stragglers under the connection row's lock, makes the new
version active with its config and deletes the old chunks, in one transaction. A failure or a
cancellation leaves the old version active; run it again with the same config and the documents
already rebuilt are skipped. Migration 0010 has the design.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ragstream.chunking import Chunker, ChunkingConfig
from ragstream.contextual import ChunkContextualizer, TitledChunk
from ragstream.core.errors import DocumentError
from ragstream.embedding.spaces import ActiveSpace
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import embedding_inputs
from ragstream.storage.rechunk import (
    RebuiltChunks,
    RechunkBusy,
    RechunkDocument,
    RechunkRunStatus,
    RechunkStore,
    UnknownConnection,
)

__all__ = ["RechunkBusy", "RechunkProgress", "Rechunker", "UnknownConnection"]

logger = logging.getLogger(__name__)


class MissingContent(DocumentError):
    """The committed version's staged content is gone: only a sync can bring the document back."""


@dataclass(slots=True)
class RechunkProgress:
    """A snapshot for progress bars and the API, like ``SyncProgress``: counts are documents."""

    connection_id: str
    index_version: int
    documents_total: int = 0
    documents_done: int = 0
    documents_failed: int = 0
    chunks: int = 0
    status: RechunkRunStatus = "running"
    error: str | None = None
    rebuilt_here: int = 0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        """Documents per second rebuilt by this run (a resumed run's earlier documents do not count)."""
        elapsed = time.monotonic() - self.started_at
        return self.rebuilt_here / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        rate = self.rate
        return max(self.documents_total - self.documents_done, 0) / rate if rate > 0 else None

    def counts(self) -> tuple[int, int, int, int]:
        return self.documents_total, self.documents_done, self.documents_failed, self.chunks


class Rechunker:
    """Runs at most one re-chunk per connection (across processes: ``RechunkStore.exclusive``).

    ``batch_size`` documents are read per query; progress is written to ``rechunk_runs`` every
    ``progress_interval_s`` seconds, however slow a document is.
    """

    def __init__(
        self,
        store: RechunkStore,
        chunking: ChunkService,
        spaces: ActiveSpace,
        *,
        batch_size: int = 16,
        progress_interval_s: float = 2.0,
        contextualizer: ChunkContextualizer | None = None,
    ) -> None:
        self._store = store
        self._chunking = chunking
        self._spaces = spaces
        self._contextualizer = contextualizer
        self._batch = batch_size
        self._interval = progress_interval_s
        self._tasks: dict[str, asyncio.Task[RechunkProgress]] = {}

    async def start(self, connection_id: str, config: ChunkingConfig) -> None:
        """Start a re-chunk of the connection in the background; returns once its run is recorded
        (``latest_run`` shows it), or raises why it could not start (``RechunkBusy``,
        ``UnknownConnection``)."""
        running = self._tasks.get(connection_id)
        if running is not None and not running.done():
            raise RechunkBusy(f"a re-chunk of connection {connection_id} is already running")
        started = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self.run(connection_id, config, on_start=lambda: started.set_result(None)))
        self._tasks[connection_id] = task
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            task.result()  # raises what stopped it

    async def cancel(self, connection_id: str) -> bool:
        """Stop this process's re-chunk of the connection (marked interrupted; a rerun resumes it).
        False when none runs here."""
        task = self._tasks.get(connection_id)
        if task is None or task.done():
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def aclose(self) -> None:
        for connection_id in list(self._tasks):
            await self.cancel(connection_id)

    async def run(
        self,
        connection_id: str,
        config: ChunkingConfig,
        on_progress: Callable[[RechunkProgress], None] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> RechunkProgress:
        """Re-chunk the connection with ``config`` and switch to it; the returned progress says
        whether it switched or failed (and why). Raises before starting (``RechunkBusy``,
        ``UnknownConnection``)."""
        notify = on_progress or (lambda _: None)
        stored = config.model_dump(mode="json")
        async with self._store.exclusive(connection_id):
            index_version = await self._store.prepare(connection_id, stored)
            progress = RechunkProgress(connection_id, index_version)
            await self._recount(progress)
            run_id = await self._store.start_run(connection_id, index_version, stored, progress.counts())
            if on_start is not None:
                on_start()
            writer = asyncio.create_task(self._write_progress(run_id, progress))
            try:
                chunker = await self._chunking.chunker(config)
                await self._backfill(chunker, progress, notify)
                if progress.documents_failed:
                    raise RuntimeError(
                        f"{progress.documents_failed} of {progress.documents_total} documents could not be"
                        f" re-chunked; first {progress.error}"
                    )
                space = await self._spaces.for_connection(connection_id)
                rebuilt = await self._store.switch(
                    connection_id,
                    index_version,
                    stored,
                    space.model_key,
                    space.embedder.dimension,
                    lambda document: self._rebuild(chunker, document),
                    self._batch,
                )
                progress.rebuilt_here += rebuilt
                await self._recount(progress)
                progress.status = "switched"
            except asyncio.CancelledError:
                progress.status = "interrupted"
                raise
            except Exception as error:  # the active version is untouched; the run row says why
                logger.warning("re-chunk of %s failed: %s", connection_id, error)
                progress.status, progress.error = "failed", str(error) or repr(error)
            finally:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
                await self._store.write_progress(run_id, progress.counts(), progress.rate, progress.eta_seconds)
                await self._store.finish_run(run_id, progress.status, progress.error)
                notify(progress)
        return progress

    async def _recount(self, progress: RechunkProgress) -> None:
        """Counts from the database: documents added, edited or deleted meanwhile change them."""
        total, done, chunks = await self._store.counts(progress.connection_id, progress.index_version)
        progress.documents_total, progress.documents_done, progress.chunks = total, done, chunks

    async def _backfill(
        self, chunker: Chunker, progress: RechunkProgress, notify: Callable[[RechunkProgress], None]
    ) -> None:
        """Passes over the documents lacking new-version chunks until one finds less than a batch
        (the rest, changed since, is left to the switch) or a document failed (the run fails; a
        rerun retries those documents only)."""
        while True:
            after, found = "", 0
            progress.documents_failed, progress.error = 0, None
            while documents := await self._store.pending(
                progress.connection_id, progress.index_version, after, self._batch
            ):
                for document in documents:
                    after = document.document_id
                    found += 1
                    try:
                        rebuilt = await self._rebuild(chunker, document)
                    except Exception as error:  # one document's failure must not stop the others
                        progress.documents_failed += 1
                        progress.error = progress.error or f"{document.source}: {error}"
                        continue
                    if await self._store.store(document, progress.index_version, rebuilt):
                        progress.rebuilt_here += 1
                        progress.documents_done += 1
                        progress.chunks += len(rebuilt.chunks)
                    notify(progress)
            await self._recount(progress)
            notify(progress)
            if progress.documents_failed or found < self._batch:
                return

    async def _rebuild(self, chunker: Chunker, document: RechunkDocument) -> RebuiltChunks:
        content = await self._store.staged(document)
        if content is None:
            raise MissingContent(f"the content of version {document.version} is no longer staged; sync it again")
        title, chunks = await self._chunking.chunk(content, document.media_type, document.title, chunker)
        space = await self._spaces.for_connection(document.connection_id)
        titled = [TitledChunk(title, chunk.heading, chunk.text) for chunk in chunks]
        vectors = await space.embedder.embed(await embedding_inputs(titled, self._contextualizer))
        return RebuiltChunks(title, chunks, vectors, space.model_key)

    async def _write_progress(self, run_id: int, progress: RechunkProgress) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._store.write_progress(run_id, progress.counts(), progress.rate, progress.eta_seconds)
