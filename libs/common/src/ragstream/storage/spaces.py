"""Embedding spaces (one vector table per model): which serves search, which a re-index fills, and its runs."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import asyncpg

from ragstream.embedding.base import Vectors

__all__ = [
    "ChunkText",
    "EmbeddingSpace",
    "ReindexBusy",
    "ReindexRun",
    "RetiredSpaceError",
    "RunStatus",
    "SpaceStatus",
    "SpaceStore",
    "lock_space",
]

SpaceStatus = Literal["active", "building", "idle", "retired"]
RunStatus = Literal["running", "switched", "failed", "interrupted"]

# Creating a space (table, index, row) is serialised across processes by this transaction lock;
# one re-index at a time by the session lock, which dies with its connection if the process does.
_CREATE_LOCK = "SELECT pg_advisory_xact_lock(hashtext('embedding_spaces'))"
_REINDEX_LOCK = 0x72696478


class RetiredSpaceError(Exception):
    """Vectors of a model that a re-index has replaced: the document must be embedded again with the
    active model (recorded as a retryable failure; the next sync or a replay does it)."""

    def __init__(self, model_key: str) -> None:
        super().__init__(f"embedding space {model_key} was retired by a re-index; re-embed with the active model")
        self.model_key = model_key


class ReindexBusy(Exception):
    """Another re-index holds the lock (in this process or another)."""


@dataclass(frozen=True, slots=True)
class EmbeddingSpace:
    model_key: str
    dimension: int
    table: str
    status: SpaceStatus
    spec: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class ChunkText:
    """What a chunk was embedded from: ``embedding_input(title, heading, text)``."""

    chunk_id: str
    title: str
    heading: str
    text: str


@dataclass(frozen=True, slots=True)
class ReindexRun:
    id: int
    source_key: str | None
    target_key: str
    status: RunStatus
    error: str | None
    chunks_total: int
    chunks_embedded: int
    rate: float | None
    eta_seconds: float | None
    started_at: datetime
    heartbeat_at: datetime
    finished_at: datetime | None


def _space(row: asyncpg.Record) -> EmbeddingSpace:
    spec = json.loads(row["spec"]) if isinstance(row["spec"], str) else row["spec"]
    return EmbeddingSpace(row["model_key"], row["dimension"], row["table_name"], row["status"], spec)


async def _create_table(connection: asyncpg.Connection, table: str, dimension: int) -> None:
    await connection.execute(
        f"CREATE TABLE {table} (chunk_id text PRIMARY KEY REFERENCES chunks (id) ON DELETE CASCADE,"
        f" embedding vector({dimension}) NOT NULL)"
    )
    await connection.execute(f"CREATE INDEX {table}_hnsw ON {table} USING hnsw (embedding vector_cosine_ops)")


async def _ensure_space(connection: asyncpg.Connection, model_key: str, dimension: int) -> EmbeddingSpace:
    """The space of ``model_key``, created idle with its table (and HNSW index) when unknown, its table
    created again when retired. The caller's transaction holds ``_CREATE_LOCK``."""
    row = await connection.fetchrow("SELECT * FROM embedding_spaces WHERE model_key = $1", model_key)
    if row is None:
        slug = re.sub(r"[^a-z0-9]+", "_", model_key.lower()).strip("_")[:40]
        table = f"embeddings_{slug}_{hashlib.sha256(model_key.encode()).hexdigest()[:6]}"
        await _create_table(connection, table, dimension)
        row = await connection.fetchrow(
            "INSERT INTO embedding_spaces (model_key, dimension, table_name) VALUES ($1, $2, $3) RETURNING *",
            model_key,
            dimension,
            table,
        )
    elif row["dimension"] != dimension:
        raise ValueError(f"{model_key} is stored with dimension {row['dimension']}, not {dimension}")
    elif row["status"] == "retired":
        await _create_table(connection, row["table_name"], dimension)
        row = await connection.fetchrow(
            "UPDATE embedding_spaces SET status = 'idle' WHERE model_key = $1 RETURNING *", model_key
        )
    assert row is not None
    return _space(row)


async def lock_space(connection: asyncpg.Connection, model_key: str, dimension: int) -> str:
    """The table for vectors of ``model_key``, its row locked FOR SHARE until the caller's transaction
    ends: a re-index switch locks the rows FOR UPDATE, so it waits for commits in flight and they wait
    for it, and no commit can slip in between its last backfill and the switch. An unknown model gets
    an idle space (side-by-side indexing, tests); a retired one is refused."""
    row = await connection.fetchrow(
        "SELECT table_name, dimension, status FROM embedding_spaces WHERE model_key = $1 FOR SHARE", model_key
    )
    if row is None:
        await connection.execute(_CREATE_LOCK)
        return (await _ensure_space(connection, model_key, dimension)).table
    if row["status"] == "retired":
        raise RetiredSpaceError(model_key)
    if row["dimension"] != dimension:
        raise ValueError(f"{model_key} is stored with dimension {row['dimension']}, not {dimension}")
    return str(row["table_name"])


class SpaceStore:
    """The SQL of space roles, the re-index backfill and switch, and re-index runs."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def active(self) -> EmbeddingSpace | None:
        row = await self._pool.fetchrow("SELECT * FROM embedding_spaces WHERE status = 'active'")
        return _space(row) if row is not None else None

    async def activate_if_none(self, model_key: str, dimension: int, spec: dict[str, Any]) -> EmbeddingSpace:
        """The active space; when there is none yet (a new database, or one from before re-indexing
        existed), the configured model's space becomes it, keeping any vectors it already has."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute(_CREATE_LOCK)
            row = await connection.fetchrow("SELECT * FROM embedding_spaces WHERE status = 'active'")
            if row is not None:
                return _space(row)
            await _ensure_space(connection, model_key, dimension)
            row = await connection.fetchrow(
                "UPDATE embedding_spaces SET status = 'active', spec = $2::jsonb WHERE model_key = $1 RETURNING *",
                model_key,
                json.dumps(spec),
            )
            assert row is not None
            return _space(row)

    async def prepare_build(self, model_key: str, dimension: int, spec: dict[str, Any]) -> EmbeddingSpace:
        """Make ``model_key`` the building space, keeping the vectors it has (a resumed re-index skips
        them). A different space left building by an abandoned re-index goes back to idle."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute(_CREATE_LOCK)
            space = await _ensure_space(connection, model_key, dimension)
            if space.status == "active":
                raise ValueError(f"{model_key} is already the active embedding space")
            await connection.execute(
                "UPDATE embedding_spaces SET status = 'idle' WHERE status = 'building' AND model_key <> $1", model_key
            )
            row = await connection.fetchrow(
                "UPDATE embedding_spaces SET status = 'building', spec = $2::jsonb WHERE model_key = $1 RETURNING *",
                model_key,
                json.dumps(spec),
            )
            assert row is not None
            return _space(row)

    async def count_chunks(self) -> int:
        return int(await self._pool.fetchval("SELECT count(*) FROM chunks"))

    async def count_vectors(self, table: str) -> int:
        return int(await self._pool.fetchval(f"SELECT count(*) FROM {table}"))

    @staticmethod
    async def _missing(
        connection: asyncpg.Connection | asyncpg.Pool, table: str, after: str, limit: int
    ) -> list[ChunkText]:
        rows = await connection.fetch(
            "SELECT c.id, d.title, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
            f" WHERE c.id > $1 AND NOT EXISTS (SELECT 1 FROM {table} e WHERE e.chunk_id = c.id)"
            " ORDER BY c.id LIMIT $2",
            after,
            limit,
        )
        return [ChunkText(row["id"], row["title"], row["heading"], row["text"]) for row in rows]

    async def missing(self, table: str, after: str, limit: int) -> list[ChunkText]:
        """Chunks without a vector in ``table``, by id after ``after`` (keyset paging: each pass
        reads every chunk once, however many are added behind it)."""
        return await self._missing(self._pool, table, after, limit)

    @staticmethod
    async def _store(connection: asyncpg.Connection, table: str, ids: Sequence[str], vectors: Vectors) -> None:
        # A chunk replaced by a newer version while it was embedded is gone: skip it, and try again
        # when its deletion committed between the EXISTS check and the foreign-key check (a savepoint
        # inside the switch's transaction, which the error would otherwise abort).
        while True:
            try:
                async with connection.transaction():
                    await connection.executemany(
                        f"INSERT INTO {table} (chunk_id, embedding) SELECT $1, $2"
                        " WHERE EXISTS (SELECT 1 FROM chunks WHERE id = $1) ON CONFLICT (chunk_id) DO NOTHING",
                        list(zip(ids, list(vectors), strict=True)),
                    )
                return
            except asyncpg.ForeignKeyViolationError:
                continue

    async def store(self, table: str, ids: Sequence[str], vectors: Vectors) -> None:
        async with self._pool.acquire() as connection:
            await self._store(connection, table, ids, vectors)

    async def switch(self, target_key: str, embed: Callable[[list[ChunkText]], Awaitable[Vectors]], batch: int) -> int:
        """Backfill what is still missing and make ``target_key`` active, in one transaction; the old
        active space is retired and its table dropped. Returns how many chunks were embedded here.

        The active and building rows are locked FOR UPDATE first: commits (``lock_space``) wait, so
        every chunk committed before the switch has a target vector and none commits to the old
        table after it. The caller leaves only the few chunks committed since its last pass."""
        embedded = 0
        async with self._pool.acquire() as connection, connection.transaction():
            rows = await connection.fetch(
                "SELECT * FROM embedding_spaces WHERE status IN ('active', 'building') ORDER BY model_key FOR UPDATE"
            )
            spaces = {row["status"]: _space(row) for row in rows}
            target = spaces.get("building")
            if target is None or target.model_key != target_key:
                raise RuntimeError(f"{target_key} is no longer the building embedding space")
            after = ""
            while chunks := await self._missing(connection, target.table, after, batch):
                await self._store(connection, target.table, [c.chunk_id for c in chunks], await embed(chunks))
                embedded += len(chunks)
                after = chunks[-1].chunk_id
            old = spaces.get("active")
            if old is not None:
                await connection.execute(
                    "UPDATE embedding_spaces SET status = 'retired' WHERE model_key = $1", old.model_key
                )
                # Dropping a table whose foreign key references chunks locks chunks exclusively too.
                # Taken first, in the order searches take them (SearchStore.snapshot: chunks, then an
                # embedding table), so a search in flight finishes instead of deadlocking with us.
                await connection.execute("LOCK TABLE chunks IN ACCESS EXCLUSIVE MODE")
                await connection.execute(f"DROP TABLE {old.table}")
            await connection.execute("UPDATE embedding_spaces SET status = 'active' WHERE model_key = $1", target_key)
        return embedded

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the re-index lock for the block; ``ReindexBusy`` when another run holds it. Runs still
        marked running are then dead (their lock went with them) and are marked interrupted."""
        async with self._pool.acquire() as connection:
            if not await connection.fetchval("SELECT pg_try_advisory_lock($1)", _REINDEX_LOCK):
                raise ReindexBusy("a re-index is already running")
            try:
                await connection.execute(
                    "UPDATE reindex_runs SET status = 'interrupted', finished_at = now() WHERE status = 'running'"
                )
                yield
            finally:
                await connection.execute("SELECT pg_advisory_unlock($1)", _REINDEX_LOCK)

    async def start_run(self, source_key: str | None, target_key: str, total: int, embedded: int) -> int:
        return int(
            await self._pool.fetchval(
                "INSERT INTO reindex_runs (source_key, target_key, status, chunks_total, chunks_embedded)"
                " VALUES ($1, $2, 'running', $3, $4) RETURNING id",
                source_key,
                target_key,
                total,
                embedded,
            )
        )

    async def write_progress(
        self, run_id: int, total: int, embedded: int, rate: float | None, eta_seconds: float | None
    ) -> None:
        await self._pool.execute(
            "UPDATE reindex_runs SET chunks_total = $2, chunks_embedded = $3, rate = $4, eta_seconds = $5,"
            " heartbeat_at = now() WHERE id = $1",
            run_id,
            total,
            embedded,
            rate,
            eta_seconds,
        )

    async def finish_run(self, run_id: int, status: RunStatus, error: str | None = None) -> None:
        await self._pool.execute(
            "UPDATE reindex_runs SET status = $2, error = $3, heartbeat_at = now(), finished_at = now(),"
            " eta_seconds = CASE WHEN $2 = 'switched' THEN 0 ELSE eta_seconds END WHERE id = $1",
            run_id,
            status,
            error,
        )

    async def latest_run(self) -> ReindexRun | None:
        row = await self._pool.fetchrow("SELECT * FROM reindex_runs ORDER BY id DESC LIMIT 1")
        if row is None:
            return None
        return ReindexRun(**{field: row[field] for field in ReindexRun.__dataclass_fields__})
