"""Index versions of a connection's chunks: the SQL of a re-chunk run and its switch (its run row is
one of ``runs``, ``storage.runs``).

Migration 0010 explains the design: chunks carry the index version they were made for, search reads
the connection's active one, a run fills the next one document by document and switches it in.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

from ragstream.core.errors import Conflict
from ragstream.core.vectors import Vectors
from ragstream.messages import ChunkPayload
from ragstream.storage.documents import chunk_id, write_chunks
from ragstream.storage.run_params import latest_params, record_params
from ragstream.storage.spaces import UnknownConnection, lock_space

__all__ = [
    "RebuiltChunks",
    "RechunkBusy",
    "RechunkDocument",
    "RechunkStore",
    "UnknownConnection",
]

# One run per connection at a time, across processes: a session lock that dies with its connection
# when the process does (two-key form: this namespace, the connection id's hash).
_LOCK_SPACE = 0x7263686B


class RechunkBusy(Conflict):
    """A re-chunk of this connection is already running (in this process or another)."""


@dataclass(frozen=True, slots=True)
class RechunkDocument:
    """An indexed document to chunk again: its committed version's staged content is the input."""

    document_id: str
    connection_id: str
    version: int
    title: str
    source: str
    media_type: str
    acl: list[str] | None


@dataclass(frozen=True, slots=True)
class RebuiltChunks:
    """A document's chunks under the new config, embedded in its connection's space."""

    title: str
    chunks: list[ChunkPayload]
    vectors: Vectors
    model_key: str


# Indexed documents of the connection without chunks of the target version, by id (keyset paging:
# a pass reads each once, however many are edited behind it). The ACL is the document's, which
# every chunk of the active version carries.
_PENDING = (
    "SELECT d.id, d.connection_id, d.version, d.title, d.source, d.media_type,"
    " (SELECT c.acl FROM chunks c WHERE c.document_id = d.id ORDER BY c.index_version, c.ordinal LIMIT 1) AS acl"
    " FROM documents d WHERE d.connection_id = $1 AND d.status = 'indexed' AND d.id > $3"
    " AND NOT EXISTS (SELECT 1 FROM chunks c WHERE c.document_id = d.id AND c.index_version = $2)"
    " ORDER BY d.id LIMIT $4"
)


class RechunkStore:
    """Run rows, the documents still to rebuild, one document's rebuilt chunks, and the switch."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @asynccontextmanager
    async def exclusive(self, connection_id: str) -> AsyncIterator[None]:
        """Hold the connection's re-chunk lock for the block; ``RechunkBusy`` when another run holds it."""
        async with self._pool.acquire() as connection:
            if not await connection.fetchval(
                "SELECT pg_try_advisory_lock($1, hashtext($2))", _LOCK_SPACE, connection_id
            ):
                raise RechunkBusy(f"a re-chunk of connection {connection_id} is already running")
            try:
                yield
            finally:
                await connection.execute("SELECT pg_advisory_unlock($1, hashtext($2))", _LOCK_SPACE, connection_id)

    async def prepare(self, run_id: int, connection_id: str, chunking: dict[str, Any]) -> int:
        """The index version to build for ``chunking``: the one an unfinished run for the same config
        left (resumed), else a new one; named in run ``run_id``'s params. Chunks of any other
        unfinished version are deleted."""
        async with self._pool.acquire() as connection, connection.transaction():
            active = await connection.fetchval(
                "SELECT index_version FROM connections WHERE id = $1 FOR UPDATE", connection_id
            )
            if active is None:
                raise UnknownConnection(connection_id)
            earlier = await latest_params(connection, "rechunk", connection_id, "index_version")
            latest = earlier[0] if earlier else None
            if latest is not None and latest["index_version"] > active and latest["chunking"] == chunking:
                target = int(latest["index_version"])
            else:
                highest = max((int(params["index_version"]) for params in earlier), default=0)
                target = max(int(active), highest) + 1
            await record_params(connection, run_id, {"index_version": target, "chunking": chunking})
            await connection.execute(
                "DELETE FROM chunks c USING documents d WHERE d.id = c.document_id AND d.connection_id = $1"
                " AND c.index_version NOT IN ($2, $3)",
                connection_id,
                active,
                target,
            )
        return target

    async def counts(self, connection_id: str, index_version: int) -> tuple[int, int, int]:
        """Indexed documents, those already with chunks of ``index_version``, and those chunks."""
        row = await self._pool.fetchrow(
            "SELECT count(*) AS total,"
            " count(*) FILTER (WHERE EXISTS (SELECT 1 FROM chunks c WHERE c.document_id = d.id"
            "  AND c.index_version = $2)) AS done,"
            " (SELECT count(*) FROM chunks c JOIN documents e ON e.id = c.document_id"
            "  WHERE e.connection_id = $1 AND c.index_version = $2) AS chunks"
            " FROM documents d WHERE d.connection_id = $1 AND d.status = 'indexed'",
            connection_id,
            index_version,
        )
        assert row is not None
        return int(row["total"]), int(row["done"]), int(row["chunks"])

    @staticmethod
    async def _pending(
        connection: asyncpg.Connection | asyncpg.Pool, connection_id: str, index_version: int, after: str, limit: int
    ) -> list[RechunkDocument]:
        rows = await connection.fetch(_PENDING, connection_id, index_version, after, limit)
        return [
            RechunkDocument(
                row["id"],
                row["connection_id"],
                row["version"],
                row["title"],
                row["source"],
                row["media_type"],
                row["acl"],
            )
            for row in rows
        ]

    async def pending(self, connection_id: str, index_version: int, after: str, limit: int) -> list[RechunkDocument]:
        """Indexed documents without chunks of ``index_version``, by id after ``after``."""
        return await self._pending(self._pool, connection_id, index_version, after, limit)

    async def staged(self, document: RechunkDocument) -> bytes | None:
        """The committed version's content (kept for replays); ``None`` when it is gone."""
        content = await self._pool.fetchval("SELECT content FROM staged_documents WHERE version = $1", document.version)
        return bytes(content) if content is not None else None

    @staticmethod
    async def _store(
        connection: asyncpg.Connection, document: RechunkDocument, index_version: int, rebuilt: RebuiltChunks
    ) -> bool:
        """Write the rebuilt chunks unless the document changed meanwhile (then a later pass or the
        switch rebuilds it from its new content). Replaces chunks of the version a crash left."""
        async with connection.transaction():
            table = await lock_space(
                connection, rebuilt.model_key, int(rebuilt.vectors.shape[1]), document.connection_id
            )
            # The lock commit_document and delete_document take: no commit slips in between.
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", document.document_id)
            current = await connection.fetchval(
                "SELECT true FROM documents WHERE id = $1 AND version = $2 AND status = 'indexed'",
                document.document_id,
                document.version,
            )
            if current is None:
                return False
            await connection.execute(
                "DELETE FROM chunks WHERE document_id = $1 AND index_version = $2", document.document_id, index_version
            )
            ids = [
                chunk_id(document.document_id, document.version, chunk.ordinal, index_version)
                for chunk in rebuilt.chunks
            ]
            await write_chunks(
                connection,
                document.document_id,
                rebuilt.title,
                rebuilt.chunks,
                ids,
                document.acl,
                index_version,
                table,
                rebuilt.vectors,
            )
        return True

    async def store(self, document: RechunkDocument, index_version: int, rebuilt: RebuiltChunks) -> bool:
        async with self._pool.acquire() as connection:
            return await self._store(connection, document, index_version, rebuilt)

    async def switch(
        self,
        connection_id: str,
        index_version: int,
        chunking: dict[str, Any],
        model_key: str,
        dimension: int,
        rebuild: Callable[[RechunkDocument], Awaitable[RebuiltChunks]],
        batch: int,
    ) -> int:
        """Rebuild what is still missing, make ``index_version`` active with ``chunking`` and delete the
        other versions' chunks, in one transaction. Returns how many documents were rebuilt here.

        The connection's embedding space is locked FOR SHARE first, then the connection row FOR UPDATE,
        the order commits take them in: commits of this connection in flight finish first, later ones
        wait and then see the new version, so no document commits old-config chunks behind the
        switch's back."""
        rebuilt = 0
        async with self._pool.acquire() as connection, connection.transaction():
            await lock_space(connection, model_key, dimension)
            active = await connection.fetchval(
                "SELECT index_version FROM connections WHERE id = $1 FOR UPDATE", connection_id
            )
            if active is None:
                raise UnknownConnection(connection_id)
            if active >= index_version:
                raise RuntimeError(f"index version {index_version} of {connection_id} is not newer than {active}")
            after = ""
            while documents := await self._pending(connection, connection_id, index_version, after, batch):
                for document in documents:
                    if await self._store(connection, document, index_version, await rebuild(document)):
                        rebuilt += 1
                    after = document.document_id
            await connection.execute(
                "UPDATE connections SET index_version = $2,"
                " config = config || jsonb_build_object('chunking', $3::jsonb), updated_at = now() WHERE id = $1",
                connection_id,
                index_version,
                json.dumps(chunking),
            )
            await connection.execute(
                "DELETE FROM chunks c USING documents d WHERE d.id = c.document_id AND d.connection_id = $1"
                " AND c.index_version <> $2",
                connection_id,
                index_version,
            )
        return rebuilt
