"""The two retrieval legs as SQL, both restricted by the same ``Scope``, and the chunk read-back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import numpy as np

from ragstream.embedding.base import Vectors
from ragstream.storage.scope import Scope

__all__ = ["ChunkRecord", "SearchStore"]

# Each term is normalised by the same 'english' configuration the index used, then the terms are
# OR-ed: a question rarely contains every word of the paragraph that answers it.
_TSQUERY = """
    SELECT NULLIF(array_to_string(ARRAY(
        SELECT '(' || plainto_tsquery('english', term)::text || ')'
        FROM unnest($1::text[]) AS term
        WHERE plainto_tsquery('english', term)::text <> ''
    ), ' | '), '')::tsquery AS query
"""


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    chunk_id: str
    document_id: str
    connection_id: str
    platform: str
    knowledge_base: str
    title: str
    source: str
    url: str | None
    heading: str
    text: str


class SearchStore:
    def __init__(self, pool: asyncpg.Pool, *, ef_search: int = 100) -> None:
        self._pool = pool
        self._ef_search = ef_search

    async def embedding_table(self, model_key: str) -> str | None:
        value = await self._pool.fetchval("SELECT table_name FROM embedding_spaces WHERE model_key = $1", model_key)
        return str(value) if value is not None else None

    async def vector_leg(self, table: str, query_vector: Vectors, limit: int, scope: Scope) -> list[str]:
        """Chunk ids nearest to the query within the scope."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute(f"SET LOCAL hnsw.ef_search = {max(self._ef_search, limit)}")
            rows = await connection.fetch(
                f"SELECT c.id FROM {table} e JOIN chunks c ON c.id = e.chunk_id {scope.joins}"
                f" WHERE {scope.sql} ORDER BY e.embedding <=> $1 LIMIT $2",
                np.asarray(query_vector, dtype=np.float32),
                limit,
                *scope.params,
            )
        return [row["id"] for row in rows]

    async def keyword_leg(self, terms: Sequence[str], limit: int, scope: Scope) -> list[str]:
        if not terms:
            return []
        rows = await self._pool.fetch(
            f"WITH q AS ({_TSQUERY}) SELECT c.id FROM q, chunks c {scope.joins}"
            f" WHERE q.query IS NOT NULL AND c.search_vector @@ q.query AND {scope.sql}"
            " ORDER BY ts_rank_cd(c.search_vector, q.query) DESC, c.id LIMIT $2",
            list(terms),
            limit,
            *scope.params,
        )
        return [row["id"] for row in rows]

    async def chunks(self, chunk_ids: Sequence[str]) -> dict[str, ChunkRecord]:
        rows = await self._pool.fetch(
            "SELECT c.id, c.document_id, d.connection_id, k.platform, d.knowledge_base, d.title, d.source, d.url,"
            " c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
            " JOIN connections k ON k.id = d.connection_id WHERE c.id = ANY($1::text[])",
            list(chunk_ids),
        )
        return {
            row["id"]: ChunkRecord(
                row["id"],
                row["document_id"],
                row["connection_id"],
                row["platform"],
                row["knowledge_base"],
                row["title"],
                row["source"],
                row["url"],
                row["heading"],
                row["text"],
            )
            for row in rows
        }
