"""The sync job: fetch announces to a transport, the job waits until it has settled; the guard,
deletions last, the cursors and the progress live here, once for both transports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ragstream.connectors.base import Connector
from ragstream.degradation import EmbeddingDegraded, EmbeddingGuard
from ragstream.jobs.progress import SyncProgress
from ragstream.messages import DocumentChanged, DocumentDeleted
from ragstream.stages.fetch import ChangeSink, FetchService, SyncCounts
from ragstream.stages.replay import ReplayCounts, ReplayService
from ragstream.storage.documents import DocumentStore, Failure
from ragstream.transport.base import Delivery, Settled, Transport

__all__ = ["SyncJob", "SyncReport"]

_Counts = TypeVar("_Counts", SyncCounts, ReplayCounts)


@dataclass(frozen=True, slots=True)
class SyncReport:
    connection_id: str
    progress: SyncProgress
    failures: list[Failure]

    @property
    def ok(self) -> bool:
        return not self.failures


class _DeletionsLast:
    """Changes go to the transport at once; deletions wait until every change has settled and the
    guard has passed, so a sync stopped by the guard deletes nothing."""

    def __init__(self, delivery: Delivery) -> None:
        self._delivery = delivery
        self.deletions: list[DocumentDeleted] = []

    async def changed(self, message: DocumentChanged) -> None:
        await self._delivery.changed(message)

    async def deleted(self, message: DocumentDeleted) -> None:
        self.deletions.append(message)


class SyncJob:
    """Runs a sync to the end over ``transport``: fetch announces changes, the transport's stages
    chunk, embed and index them, then the deletions follow.

    Both sides keep a cursor (``sync_cursors``): the fetch's ``download`` walk and the ``index`` walk,
    which completes only once everything announced has settled. A sync that stops before that leaves
    the index walk unfinished, and the next sync announces what is staged but not indexed again from
    the staging store instead of downloading it again.

    Once more than ``max_unembedded_ratio`` of the guard's sample came back without a vector, the sync
    raises ``EmbeddingDegraded`` and deletes nothing (see ``ragstream.degradation``)."""

    def __init__(
        self,
        store: DocumentStore,
        transport: Transport,
        *,
        max_document_bytes: int,
        max_unembedded_ratio: float = 0.8,
        guard_min_chunks: int = 20,
    ) -> None:
        self._store = store
        self._transport = transport
        self._max_bytes = max_document_bytes
        self._max_unembedded_ratio = max_unembedded_ratio
        self._guard_min_chunks = guard_min_chunks

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
        # The index walk has no position: documents settle in any order, and what matters is only
        # whether it completed (else the next sync announces what is staged again).
        index_walk = await cursors.begin(connection_id, "index")

        async def announce(sink: ChangeSink) -> SyncCounts:
            counts = await fetch.run(sink, index_unfinished=index_walk.resumed)
            # Also when nothing was listed (an empty folder), which the per-item callback never sees.
            progress.direction, progress.resumed = counts.direction, counts.resumed
            progress.skipped = counts.skipped
            progress.failed_fetching = counts.failed
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
        """Run ``announce`` into the transport, wait until it has settled, check the guard, then
        announce the deletions and wait for them too."""

        def settled(state: Settled) -> None:
            progress.indexed, progress.failed_processing = state.indexed, state.failed
            progress.chunks, progress.deleted = state.chunks, state.deleted
            guard.embedded, guard.failed = state.vectors, state.missing_vectors
            notify(progress)
            guard.check()

        try:
            async with self._transport.open(settled) as delivery:
                held = _DeletionsLast(delivery)
                counts = await announce(held)
                progress.listing_done = True
                notify(progress)
                await delivery.settle()
                guard.check(final=True)
                for deletion in held.deletions:
                    await delivery.deleted(deletion)
                await delivery.settle()
        except* EmbeddingDegraded as degraded:
            raise degraded.exceptions[0] from None
        notify(progress)
        return counts
