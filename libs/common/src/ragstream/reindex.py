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

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ragstream.contextual import ChunkContextualizer
from ragstream.embedding.base import Embedder, Vectors
from ragstream.embedding.spaces import ActiveSpace
from ragstream.jobs.progress import RunProgress
from ragstream.stages.embed import embedding_inputs
from ragstream.storage.spaces import ChunkText, ReindexBusy, SpaceStore, UnknownConnection

__all__ = ["ReindexBusy", "ReindexProgress", "Reindexer", "UnknownConnection"]


@dataclass(slots=True, kw_only=True)
class ReindexProgress(RunProgress):
    """A re-index's counts: chunks to embed, and those with a vector in the target space."""

    chunks_total: int = 0
    chunks_embedded: int = 0
    # Embedded by this run (a resumed run's earlier chunks do not count for its rate).
    embedded_here: int = 0

    @property
    def total(self) -> int:
        return self.chunks_total

    @property
    def done(self) -> int:
        return self.chunks_embedded

    @property
    def processed(self) -> int:
        return self.embedded_here

    def counts(self) -> dict[str, Any]:
        return {"chunks_total": self.chunks_total, "chunks_embedded": self.chunks_embedded}


class Reindexer:
    """Runs one deployment-wide re-index, or one per connection, at a time (across processes:
    ``SpaceStore.exclusive``), each as a ``reindex`` run the runner executes: its row gets the
    source and target keys here, its progress is what ``on_progress`` is given.

    ``batch_size`` chunks go to the embedder per call.
    """

    def __init__(
        self,
        store: SpaceStore,
        spaces: ActiveSpace,
        *,
        batch_size: int = 64,
        contextualizer: ChunkContextualizer | None = None,
    ) -> None:
        self._store = store
        self._spaces = spaces
        self._contextualizer = contextualizer
        self._batch = batch_size

    def target(self, spec: dict[str, Any]) -> Embedder:
        """The embedder of a deployment-wide re-index to the model ``spec`` names."""
        return self._spaces.build(spec)

    async def run(
        self,
        run_id: int,
        target: Embedder,
        spec: dict[str, Any],
        on_progress: Callable[[ReindexProgress], None] | None = None,
    ) -> ReindexProgress:
        """Re-index the connections following the default into ``target``'s space (its ``spec``
        stored with it) and make it the active one, adopting ``target`` as its embedder; closed
        otherwise. Raises why it could not (``ReindexBusy``, a ``ValueError`` when it is the active
        model already, any error of the backfill or the switch): the current space is then
        untouched, and a rerun resumes."""
        switched = False
        try:
            async with self._store.exclusive():
                space, _ = await self._store.prepare_build(run_id, target.model_key, target.dimension, spec)
                progress = ReindexProgress(
                    chunks_total=await self._store.count_chunks(),
                    chunks_embedded=await self._store.count_vectors(space.table),
                )

                async def switch() -> int:
                    return await self._store.switch(
                        target.model_key, lambda chunks: self._embed(target, chunks), self._batch
                    )

                await self._follow(target, space.table, None, progress, switch, on_progress)
                self._spaces.adopt(target)
                switched = True
                self._spaces.invalidate()
        finally:
            if not switched:
                await target.aclose()
        return progress

    async def run_connection(
        self,
        run_id: int,
        connection_id: str,
        spec: dict[str, Any] | None,
        on_progress: Callable[[ReindexProgress], None] | None = None,
    ) -> ReindexProgress:
        """Re-index one connection's chunks into the space of the model ``spec`` names and pin the
        connection to it (``spec`` ``None``: into the active space, and it follows the default
        again); its ``config.embedding`` becomes ``spec`` on the switch. Raises why it could not
        (``ReindexBusy``, ``UnknownConnection``, a ``ValueError`` when it is its model already, any
        error of the backfill or the switch)."""
        async with self._store.exclusive(connection_id):
            if spec is None:
                target, stored = (await self._spaces.current()).embedder, {}
            else:
                target, stored = await self._spaces.resolve(spec), spec
            space, source = await self._store.prepare_connection_build(
                run_id, connection_id, target.model_key, target.dimension, stored, spec is not None
            )
            progress = ReindexProgress(
                chunks_total=await self._store.count_chunks(connection_id),
                chunks_embedded=await self._store.count_vectors(space.table, connection_id),
            )
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
            await self._follow(target, space.table, connection_id, progress, switch, on_progress)
            self._spaces.invalidate()
        return progress

    async def _follow(
        self,
        target: Embedder,
        table: str,
        scope: str | None,
        progress: ReindexProgress,
        switch: Callable[[], Awaitable[int]],
        on_progress: Callable[[ReindexProgress], None] | None,
    ) -> None:
        """Backfill, then switch."""
        notify = on_progress or (lambda _: None)
        notify(progress)
        await self._backfill(target, table, scope, progress, notify)
        embedded = await switch()
        progress.chunks_embedded += embedded
        progress.embedded_here += embedded
        notify(progress)

    async def _backfill(
        self,
        target: Embedder,
        table: str,
        scope: str | None,
        progress: ReindexProgress,
        notify: Callable[[ReindexProgress], None],
    ) -> None:
        """Passes over the chunks lacking a target vector until one finds less than a batch: the
        rest (committed since) is left to the switch, which embeds it holding the commit lock."""
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
