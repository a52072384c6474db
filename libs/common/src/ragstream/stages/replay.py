"""Replay: announce failed document versions again, from the failures table or the dead-letter topic.

A failed version keeps its staged content and the header its failing stage received, so a replay
re-drives it from the chunker on without asking the source: the fix (a provider back up, a quota
raised, a bug fixed) is all it takes. The version stays the same, so a replay racing a newer sync
loses cleanly: stages skip superseded versions and the indexer never commits an older one.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

from ragstream.messages import DeadLetter, DocumentChanged, DocumentHeader
from ragstream.stages.fetch import ChangeSink
from ragstream.storage.documents import DocumentStore

__all__ = ["OnReplayed", "ReplayCounts", "ReplayService"]


@dataclass(slots=True)
class ReplayCounts:
    replayed: int = 0
    # Failed before their content was staged (unreadable, too large): the next sync fetches them.
    needs_sync: int = 0
    # Dead letters no longer their document's failing version: committed, deleted or superseded since.
    resolved: int = 0


OnReplayed = Callable[[ReplayCounts], None]
"""Sees the counts after every document re-driven or found resolved: a long replay shows progress."""


def _unobserved(counts: ReplayCounts) -> None:
    """The default :data:`OnReplayed`: nobody watches this replay."""


class ReplayService:
    def __init__(self, store: DocumentStore) -> None:
        self._store = store

    async def failures(
        self, sink: ChangeSink, connection_id: str | None = None, on_replayed: OnReplayed = _unobserved
    ) -> ReplayCounts:
        """Re-drive every replayable failure (of one connection, or all)."""
        headers, needs_sync = await self._store.replayable(connection_id)
        counts = ReplayCounts(needs_sync=needs_sync)
        for header in headers:
            await sink.changed(DocumentChanged(header=header))
            counts.replayed += 1
            on_replayed(counts)
        return counts

    async def dead_letters(
        self,
        letters: AsyncIterable[DeadLetter],
        sink: ChangeSink,
        connection_id: str | None = None,
        on_replayed: OnReplayed = _unobserved,
    ) -> ReplayCounts:
        """Re-drive the dead letters that are still their document's failing version.

        The topic keeps every failure for 30 days, so the same document may appear many times:
        only its newest letter counts, and only while the database still holds it as failed.
        """
        newest: dict[str, DocumentHeader] = {}
        for letter in [letter async for letter in letters]:
            header = letter.header
            if header is None:  # a message no stage could read: nothing in it to re-drive
                continue
            if connection_id is not None and header.connection_id != connection_id:
                continue
            known = newest.get(header.document_id)
            if known is None or known.version < header.version:
                newest[header.document_id] = header
        counts = ReplayCounts()
        for header in sorted(newest.values(), key=lambda header: header.version):
            if await self._store.is_replayable(header):
                await sink.changed(DocumentChanged(header=header))
                counts.replayed += 1
            else:
                counts.resolved += 1
            on_replayed(counts)
        return counts
