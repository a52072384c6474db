"""What the stages after the fetcher did with the changes and deletions a sync announced: in Kafka mode
a sync's indexed, failed, chunk and deletion counts are read from here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

__all__ = ["Downstream", "DownstreamStore"]


@dataclass(frozen=True, slots=True)
class Downstream:
    """Of the announced changes: how many committed (with how many chunks) and how many failed."""

    indexed: int
    failed: int
    chunks: int
    # Of the failed: those that failed at the embed step (the degradation guard's sample in Kafka mode).
    failed_embedding: int = 0

    def settled(self, announced: int) -> bool:
        """Every announced change is committed or failed for good."""
        return self.indexed + self.failed >= announced


class DownstreamStore:
    """Reads of ``documents`` and ``open_document_failures`` for announced ``(document id, version)`` pairs."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def downstream(self, announced: Sequence[tuple[str, int]]) -> Downstream:
        """Of these announced changes (a sync's ``(document id, version)`` pairs): how many have
        committed, with how many chunks, and how many failed for good. Only the announced version
        or a newer one counts, never an older version still in flight (from an earlier, killed run)
        that commits or fails after this run began. A failure a stage is still retrying counts as
        neither, and so does an older version committed while the announced one is failing."""
        row = await self._pool.fetchrow(
            "SELECT count(*) FILTER (WHERE committed) AS indexed,"
            " coalesce(sum(d.chunk_count) FILTER (WHERE committed), 0) AS chunks,"
            " count(*) FILTER (WHERE f.document_id IS NOT NULL AND NOT f.retrying) AS failed,"
            " count(*) FILTER (WHERE f.document_id IS NOT NULL AND NOT f.retrying AND f.step = 'embed')"
            " AS failed_embedding"
            " FROM unnest($1::text[], $2::bigint[]) AS announced (id, version)"
            " LEFT JOIN documents d ON d.id = announced.id"
            " LEFT JOIN open_document_failures f ON f.document_id = announced.id AND f.version >= announced.version,"
            " LATERAL (SELECT d.status = 'indexed' AND d.version >= announced.version AND f.document_id IS NULL"
            " AS committed) c",
            [document_id for document_id, _ in announced],
            [version for _, version in announced],
        )
        assert row is not None
        return Downstream(
            indexed=row["indexed"], failed=row["failed"], chunks=row["chunks"], failed_embedding=row["failed_embedding"]
        )

    async def deletions(self, announced: Sequence[tuple[str, int]]) -> tuple[int, int]:
        """Of these announced deletions (``(document id, version)`` pairs): how many the indexer has
        applied, and how many have settled (applied, or outranked by a newer version committed since)."""
        row = await self._pool.fetchrow(
            "SELECT count(*) FILTER (WHERE d.status = 'deleted') AS deleted, count(d.id) AS settled"
            " FROM unnest($1::text[], $2::bigint[]) AS announced (id, version)"
            " LEFT JOIN documents d ON d.id = announced.id AND d.version >= announced.version",
            [document_id for document_id, _ in announced],
            [version for _, version in announced],
        )
        assert row is not None
        return int(row["deleted"]), int(row["settled"])
