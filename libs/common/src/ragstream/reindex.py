"""Re-index without downtime: fill a new embedding space from the committed chunks, then switch it in.

Deployment-wide, it covers the connections that follow the default space; for one connection, only
its chunks (migration 0012). Search keeps using the current space while the target is filled; ingest
keeps committing with the current model, and the backfill loop picks those chunks up too. The switch
(``SpaceStore.switch`` / ``switch_connection``) embeds the last stragglers under a lock that commits
also take and moves the chunks' connections to the target, dropping the old table when nothing uses
it any more, all in one transaction. A failure or a cancellation leaves the current space as it was;
run it again and the chunks already embedded are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ragstream.contextual import ChunkContextualizer
from ragstream.embedding.base import Embedder, Vectors
from ragstream.embedding.spaces import ActiveSpace
from ragstream.stages.embed import embedding_inputs
from ragstream.storage.spaces import ChunkText, ReindexBusy, RunStatus, SpaceStore, UnknownConnection

__all__ = ["ReindexBusy", "ReindexProgress", "Reindexer", "UnknownConnection"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ReindexProgress:
    """A snapshot for progress bars and the API, like ``SyncProgress``: counts are chunks."""

    target_key: str
    source_key: str | None
    connection_id: str | None = None
    chunks_total: int = 0
    chunks_embedded: int = 0
    status: RunStatus = "running"
    error: str | None = None
    embedded_here: int = 0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        """Chunks per second embedded by this run (a resumed run's earlier chunks do not count)."""
        elapsed = time.monotonic() - self.started_at
        return self.embedded_here / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        rate = self.rate
        return max(self.chunks_total - self.chunks_embedded, 0) / rate if rate > 0 else None


class Reindexer:
    """Runs one deployment-wide re-index, or one per connection, at a time (across processes:
    ``SpaceStore.exclusive``).

    ``batch_size`` chunks go to the embedder per call; progress is written to ``reindex_runs``
    every ``progress_interval_s`` seconds, however slow a batch is.
    """

    def __init__(
        self,
        store: SpaceStore,
        spaces: ActiveSpace,
        *,
        batch_size: int = 64,
        progress_interval_s: float = 2.0,
        contextualizer: ChunkContextualizer | None = None,
    ) -> None:
        self._store = store
        self._spaces = spaces
        self._contextualizer = contextualizer
        self._batch = batch_size
        self._interval = progress_interval_s
        self._tasks: dict[str | None, asyncio.Task[ReindexProgress]] = {}

    async def start(self, spec: dict[str, Any] | None, connection_id: str | None = None) -> None:
        """Start a re-index to the model ``spec`` names in the background, of the whole deployment
        or of one connection (``spec`` ``None``: back to the default model); returns once its run is
        recorded (``latest_run`` shows it), or raises why it could not start (``ReindexBusy``,
        ``UnknownConnection``, a ``ValueError`` about the spec)."""
        running = self._tasks.get(connection_id)
        if running is not None and not running.done():
            raise ReindexBusy("a re-index is already running")
        started = asyncio.get_running_loop().create_future()
        if connection_id is None:
            if spec is None:
                raise ValueError("a deployment-wide re-index needs a target model")
            target = self._spaces.build(spec)
            work = self.run(target, spec, on_start=lambda: started.set_result(None))
        else:
            target = None
            work = self.run_connection(connection_id, spec, on_start=lambda: started.set_result(None))
        task = asyncio.create_task(work)
        self._tasks[connection_id] = task
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            if target is not None:
                await target.aclose()
            task.result()  # raises what stopped it

    async def cancel(self, connection_id: str | None = None) -> bool:
        """Stop this process's re-index (of the connection): it is marked interrupted and resumes when
        started again. False when none runs here."""
        task = self._tasks.get(connection_id)
        if task is None or task.done():
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def aclose(self) -> None:
        """Stop every background re-index of this process."""
        for key in list(self._tasks):
            await self.cancel(key)

    async def run(
        self,
        target: Embedder,
        spec: dict[str, Any],
        on_progress: Callable[[ReindexProgress], None] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> ReindexProgress:
        """Re-index the connections following the default into ``target``'s space and make it the
        active one; the returned progress says whether it switched or failed (and why). Once the run
        has started, ``target`` is handed to the active space if it switched and closed otherwise;
        raising before (``ReindexBusy``, a ``ValueError`` when it is the active model already), it
        stays the caller's."""
        async with self._store.exclusive():
            space = await self._store.prepare_build(target.model_key, target.dimension, spec)
            active = await self._store.active()
            progress = ReindexProgress(
                target.model_key,
                active.model_key if active is not None else None,
                None,
                await self._store.count_chunks(),
                await self._store.count_vectors(space.table),
            )
            run_id = await self._store.start_run(
                progress.source_key, progress.target_key, progress.chunks_total, progress.chunks_embedded
            )
            if on_start is not None:
                on_start()

            async def switch() -> int:
                return await self._store.switch(
                    target.model_key, lambda chunks: self._embed(target, chunks), self._batch
                )

            try:
                await self._follow(run_id, target, space.table, progress, switch, on_progress, adopt=True)
            finally:
                if progress.status != "switched":
                    await target.aclose()
        return progress

    async def run_connection(
        self,
        connection_id: str,
        spec: dict[str, Any] | None,
        on_progress: Callable[[ReindexProgress], None] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> ReindexProgress:
        """Re-index one connection's chunks into the space of the model ``spec`` names and pin the
        connection to it (``spec`` ``None``: into the active space, and it follows the default
        again); its ``config.embedding`` becomes ``spec`` on the switch. Raises before starting
        (``ReindexBusy``, ``UnknownConnection``, a ``ValueError`` when it is its model already)."""
        async with self._store.exclusive(connection_id):
            if spec is None:
                target, stored = (await self._spaces.current()).embedder, {}
            else:
                target, stored = await self._spaces.resolve(spec), spec
            space, source, run_id = await self._store.prepare_connection_build(
                connection_id, target.model_key, target.dimension, stored, spec is not None
            )
            progress = ReindexProgress(
                target.model_key,
                source,
                connection_id,
                await self._store.count_chunks(connection_id),
                await self._store.count_vectors(space.table, connection_id),
            )
            if on_start is not None:
                on_start()
            choice = {key: value for key, value in spec.items() if value is not None} if spec is not None else None

            async def switch() -> int:
                return await self._store.switch_connection(
                    connection_id,
                    source,
                    target.model_key,
                    spec is not None,
                    choice,
                    lambda chunks: self._embed(target, chunks),
                    self._batch,
                )

            # The target is the active space's embedder, or one ``resolve`` handed to it already.
            await self._follow(run_id, target, space.table, progress, switch, on_progress, adopt=False)
        return progress

    async def _follow(
        self,
        run_id: int,
        target: Embedder,
        table: str,
        progress: ReindexProgress,
        switch: Callable[[], Awaitable[int]],
        on_progress: Callable[[ReindexProgress], None] | None,
        *,
        adopt: bool,
    ) -> None:
        """Backfill, switch, and keep the run row up to date until it ends (``progress.status``).
        ``adopt``: once switched, ``target`` becomes the active space's embedder of its model."""
        notify = on_progress or (lambda _: None)
        writer = asyncio.create_task(self._write_progress(run_id, progress))
        try:
            await self._backfill(target, table, progress, notify)
            embedded = await switch()
            progress.chunks_embedded += embedded
            progress.embedded_here += embedded
            progress.status = "switched"
            if adopt:
                self._spaces.adopt(target)
            self._spaces.invalidate()
        except asyncio.CancelledError:
            progress.status = "interrupted"
            raise
        except Exception as error:  # the current space is untouched; the run row says why
            logger.warning("re-index to %s failed: %s", target.model_key, error)
            progress.status, progress.error = "failed", str(error) or repr(error)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self._store.write_progress(
                run_id, progress.chunks_total, progress.chunks_embedded, progress.rate, progress.eta_seconds
            )
            await self._store.finish_run(run_id, progress.status, progress.error)
            notify(progress)

    async def _backfill(
        self, target: Embedder, table: str, progress: ReindexProgress, notify: Callable[[ReindexProgress], None]
    ) -> None:
        """Passes over the chunks lacking a target vector until one finds less than a batch: the
        rest (committed since) is left to the switch, which embeds it holding the commit lock."""
        scope = progress.connection_id
        while True:
            after, found = "", 0
            while chunks := await self._store.missing(table, after, self._batch, scope):
                await self._store.store(table, [chunk.chunk_id for chunk in chunks], await self._embed(target, chunks))
                found += len(chunks)
                progress.chunks_embedded += len(chunks)
                progress.embedded_here += len(chunks)
                after = chunks[-1].chunk_id
                notify(progress)
            # Recount: chunks deleted or replaced meanwhile took their vectors with them.
            progress.chunks_total = await self._store.count_chunks(scope)
            progress.chunks_embedded = await self._store.count_vectors(table, scope)
            notify(progress)
            if found < self._batch:
                return

    async def _embed(self, target: Embedder, chunks: list[ChunkText]) -> Vectors:
        return await target.embed(await embedding_inputs(chunks, self._contextualizer))

    async def _write_progress(self, run_id: int, progress: ReindexProgress) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._store.write_progress(
                run_id, progress.chunks_total, progress.chunks_embedded, progress.rate, progress.eta_seconds
            )
