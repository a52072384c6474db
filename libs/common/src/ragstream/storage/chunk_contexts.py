"""The contextual-retrieval cache: one chat-written context line per chunk digest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import asyncpg

__all__ = ["ChunkContextStore"]


class ChunkContextStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def get_many(self, digests: Sequence[bytes]) -> dict[bytes, str]:
        """The cached contexts of those digests that have one."""
        rows = await self._pool.fetch(
            "SELECT digest, context FROM chunk_contexts WHERE digest = ANY($1::bytea[])", list(digests)
        )
        return {bytes(row["digest"]): row["context"] for row in rows}

    async def put_many(self, contexts: Mapping[bytes, str]) -> None:
        """Store new contexts; a digest another worker stored meanwhile keeps its first context."""
        if contexts:
            await self._pool.executemany(
                "INSERT INTO chunk_contexts (digest, context) VALUES ($1, $2) ON CONFLICT (digest) DO NOTHING",
                list(contexts.items()),
            )
