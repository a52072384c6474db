"""Re-index without downtime: fill a new embedding space from the committed chunks, then switch it in.

Search keeps using the active space while the target space is filled; ingest keeps committing with
the active model, and the backfill loop picks those chunks up too. The switch (``SpaceStore.switch``)
embeds the last stragglers under a lock that commits also take, makes the target active and drops
the old table, all in one transaction. A failure or a cancellation leaves the active space as it
was; run it again and the chunks already embedded are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ragstream.embedding.base import Embedder, Vectors
from ragstream.embedding.spaces import ActiveSpace
from ragstream.stages.embed import embedding_input
from ragstream.storage.spaces import ChunkText, ReindexBusy, RunStatus, SpaceStore

__all__ = ["ReindexBusy", "ReindexProgress", "Reindexer"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ReindexProgress:
    """A snapshot for progress bars and the API, like ``SyncProgress``: counts are chunks."""

    target_key: str
    source_key: str | None
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
    """Runs one re-index at a time (across processes: ``SpaceStore.exclusive``).

    ``batch_size`` chunks go to the embedder per call; progress is written to ``reindex_runs``
    every ``progress_interval_s`` seconds, however slow a batch is.
    """

    def __init__(
        self, store: SpaceStore, spaces: ActiveSpace, *, batch_size: int = 64, progress_interval_s: float = 2.0
    ) -> None:
        self._store = store
        self._spaces = spaces
        self._batch = batch_size
        self._interval = progress_interval_s
        self._task: asyncio.Task[ReindexProgress] | None = None

    async def start(self, spec: dict[str, Any]) -> None:
        """Start a re-index to the model ``spec`` names in the background; returns once its run is
        recorded (``GET /v1/reindex`` shows it), or raises why it could not start."""
        if self._task is not None and not self._task.done():
            raise ReindexBusy("a re-index is already running")
        target = self._spaces.build(spec)
        started = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self.run(target, spec, on_start=lambda: started.set_result(None)))
        self._task = task
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            await target.aclose()
            task.result()  # raises what stopped it: ReindexBusy, or a ValueError about the spec

    async def aclose(self) -> None:
        """Stop a background re-index (it is marked interrupted and resumes when started again)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(
        self,
        target: Embedder,
        spec: dict[str, Any],
        on_progress: Callable[[ReindexProgress], None] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> ReindexProgress:
        """Re-index into ``target``'s space and switch to it; the returned progress says whether it
        switched or failed (and why). Once the run has started, ``target`` is handed to the active
        space if it switched and closed otherwise; raising before (``ReindexBusy``, a ``ValueError``
        when it is the active model already), it stays the caller's."""
        notify = on_progress or (lambda _: None)
        async with self._store.exclusive():
            space = await self._store.prepare_build(target.model_key, target.dimension, spec)
            active = await self._store.active()
            progress = ReindexProgress(
                target.model_key,
                active.model_key if active is not None else None,
                await self._store.count_chunks(),
                await self._store.count_vectors(space.table),
            )
            run_id = await self._store.start_run(
                progress.source_key, progress.target_key, progress.chunks_total, progress.chunks_embedded
            )
            if on_start is not None:
                on_start()
            writer = asyncio.create_task(self._write_progress(run_id, progress))
            try:
                await self._backfill(target, space.table, progress, notify)
                embedded = await self._store.switch(
                    target.model_key, lambda chunks: self._embed(target, chunks), self._batch
                )
                progress.chunks_embedded += embedded
                progress.embedded_here += embedded
                progress.status = "switched"
                self._spaces.adopt(target)
                self._spaces.invalidate()
            except asyncio.CancelledError:
                progress.status = "interrupted"
                raise
            except Exception as error:  # the active space is untouched; the run row says why
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
                if progress.status != "switched":
                    await target.aclose()
        return progress

    async def _backfill(
        self, target: Embedder, table: str, progress: ReindexProgress, notify: Callable[[ReindexProgress], None]
    ) -> None:
        """Passes over the chunks lacking a target vector until one finds less than a batch: the
        rest (committed since) is left to the switch, which embeds it holding the commit lock."""
        while True:
            after, found = "", 0
            while chunks := await self._store.missing(table, after, self._batch):
                await self._store.store(table, [chunk.chunk_id for chunk in chunks], await self._embed(target, chunks))
                found += len(chunks)
                progress.chunks_embedded += len(chunks)
                progress.embedded_here += len(chunks)
                after = chunks[-1].chunk_id
                notify(progress)
            # Recount: chunks deleted or replaced meanwhile took their vectors with them.
            progress.chunks_total = await self._store.count_chunks()
            progress.chunks_embedded = await self._store.count_vectors(table)
            notify(progress)
            if found < self._batch:
                return

    async def _embed(self, target: Embedder, chunks: list[ChunkText]) -> Vectors:
        return await target.embed([embedding_input(chunk.title, chunk.heading, chunk.text) for chunk in chunks])

    async def _write_progress(self, run_id: int, progress: ReindexProgress) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._store.write_progress(
                run_id, progress.chunks_total, progress.chunks_embedded, progress.rate, progress.eta_seconds
            )
