"""Embedding spaces (one vector table per model): which serves search, and which a re-index fills."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg

from ragstream.core.errors import Conflict, DocumentError, NotFound
from ragstream.core.vectors import Vectors, vector_blocks
from ragstream.storage.run_params import record_params
from ragstream.storage.sql import identifier

__all__ = [
    "ChunkText",
    "EmbeddingSpace",
    "ReindexBusy",
    "RetiredSpaceError",
    "SpaceStatus",
    "SpaceStore",
    "UnknownConnection",
    "drop_space_if_unused",
    "lock_space",
    "pin_space",
]

SpaceStatus = Literal["active", "building", "idle", "retired"]

# Creating a space (table, index, row) is serialised across processes by this transaction lock;
# one re-index at a time by the session lock, which dies with its connection if the process does.
_CREATE_LOCK = "SELECT pg_advisory_xact_lock(hashtext('embedding_spaces'))"
_REINDEX_LOCK = 0x72696478
_SET_STATUS = "UPDATE embedding_spaces SET status = $2 WHERE model_key = $1"
# A connection k's effective space: the one it is pinned to, else the active one.
_EFFECTIVE = "coalesce(k.embedding_model_key, (SELECT model_key FROM embedding_spaces WHERE status = 'active'))"
# Two-key lock of one connection's re-index (this namespace, the connection id's hash).
_CONNECTION_LOCK = 0x72696463


class RetiredSpaceError(DocumentError):
    """Vectors of a model that a re-index has replaced, for the deployment or for the document's
    connection: the document must be embedded again with the connection's model (recorded as a
    retryable failure; the embedded pipeline does it at once, the next sync or a replay otherwise)."""

    retryable = True

    def __init__(self, model_key: str, connection_id: str | None = None) -> None:
        whose = f"connection {connection_id}" if connection_id else "the deployment"
        super().__init__(
            f"embedding space {model_key} is not the one of {whose} any more (a re-index replaced it);"
            " re-embed with its current model"
        )
        self.model_key = model_key


class ReindexBusy(Conflict):
    """Another re-index holds the lock (in this process or another)."""


class UnknownConnection(NotFound, LookupError):
    """No connection with this id."""


@dataclass(frozen=True, slots=True)
class EmbeddingSpace:
    model_key: str
    dimension: int
    table: str
    status: SpaceStatus
    spec: dict[str, Any] | None
    # Its own fusion weights (``embedding_spaces.fusion``), None when it has none.
    fusion: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChunkText:
    """What a chunk was embedded from: ``embedding_input(title, heading, text)``."""

    chunk_id: str
    title: str
    heading: str
    text: str


def _space(row: asyncpg.Record) -> EmbeddingSpace:
    spec, fusion = (json.loads(value) if isinstance(value, str) else value for value in (row["spec"], row["fusion"]))
    return EmbeddingSpace(row["model_key"], row["dimension"], row["table_name"], row["status"], spec, fusion)


async def _create_table(connection: asyncpg.Connection, table: str, model_key: str, dimension: int) -> None:
    """The space's vector table with its HNSW index, or one index per block for a model whose vectors
    are made of blocks searched apart (``core.vectors.BLOCKS``)."""
    await connection.execute(
        f"CREATE TABLE {identifier(table)} (chunk_id text PRIMARY KEY REFERENCES chunks (id) ON DELETE CASCADE,"
        f" embedding vector({dimension}) NOT NULL)"
    )
    blocks = vector_blocks(model_key)
    for name, indexed in [(block.name, block.sql("embedding")) for block in blocks] or [("", "embedding")]:
        index = f"{table}_{name}_hnsw" if name else f"{table}_hnsw"
        await connection.execute(
            f"CREATE INDEX {identifier(index)} ON {identifier(table)} USING hnsw ({indexed} vector_cosine_ops)"
        )


async def _ensure_space(connection: asyncpg.Connection, model_key: str, dimension: int) -> EmbeddingSpace:
    """The space of ``model_key``, created idle with its table (and HNSW index) when unknown, its table
    created again when retired. The caller's transaction holds ``_CREATE_LOCK``."""
    row = await connection.fetchrow("SELECT * FROM embedding_spaces WHERE model_key = $1", model_key)
    if row is None:
        slug = re.sub(r"[^a-z0-9]+", "_", model_key.lower()).strip("_")[:40]
        table = f"embeddings_{slug}_{hashlib.sha256(model_key.encode()).hexdigest()[:6]}"
        await _create_table(connection, table, model_key, dimension)
        row = await connection.fetchrow(
            "INSERT INTO embedding_spaces (model_key, dimension, table_name) VALUES ($1, $2, $3) RETURNING *",
            model_key,
            dimension,
            table,
        )
    elif row["dimension"] != dimension:
        raise ValueError(f"{model_key} is stored with dimension {row['dimension']}, not {dimension}")
    elif row["status"] == "retired":
        await _create_table(connection, row["table_name"], model_key, dimension)
        row = await connection.fetchrow(
            "UPDATE embedding_spaces SET status = 'idle' WHERE model_key = $1 RETURNING *", model_key
        )
    assert row is not None
    return _space(row)


# Whether a commit of the connection ($1) may write vectors of model $2: its effective model (pinned,
# else the active one; any model when there is no active space yet), its re-index target (the building
# space while it follows the default, or a running re-index of its own), or a side-by-side space that
# serves no connection (an unknown model, an idle space nobody is pinned to: tests and benchmarks
# index beside the pipeline that way). Locks the connection row FOR KEY SHARE: a per-connection switch
# (FOR UPDATE) waits for this commit, or this commit sees what the switch made effective, while plain
# updates of the row (sync status, a rename) do not wait for commits.
_MAY_COMMIT = """
    SELECT $2 = coalesce(k.embedding_model_key, (SELECT model_key FROM embedding_spaces WHERE status = 'active'), $2)
        OR (k.embedding_model_key IS NULL
            AND EXISTS (SELECT 1 FROM embedding_spaces s WHERE s.model_key = $2 AND s.status = 'building'))
        OR EXISTS (SELECT 1 FROM runs r
                   WHERE r.kind = 'reindex' AND r.connection_id = k.id AND r.params->>'target_key' = $2
                   AND r.status = 'running')
        OR (NOT EXISTS (SELECT 1 FROM embedding_spaces s WHERE s.model_key = $2 AND s.status IN ('active', 'retired'))
            AND NOT EXISTS (SELECT 1 FROM connections p WHERE p.embedding_model_key = $2))
    FROM connections k WHERE k.id = $1 FOR KEY SHARE
"""


async def lock_space(
    connection: asyncpg.Connection, model_key: str, dimension: int, connection_id: str | None = None
) -> str:
    """The table for vectors of ``model_key``, its row locked FOR SHARE until the caller's transaction
    ends: a re-index switch locks the rows FOR UPDATE, so it waits for commits in flight and they wait
    for it, and no commit can slip in between its last backfill and the switch. An unknown model gets
    an idle space (side-by-side indexing, tests); a retired one is refused.

    With ``connection_id``, the vectors are for that connection's chunks: its row is locked FOR KEY
    SHARE too (after the space's, the order every switch takes them in), and a model that is not the
    connection's to write (``_MAY_COMMIT``) is refused with ``RetiredSpaceError``."""
    row = await connection.fetchrow(
        "SELECT table_name, dimension, status FROM embedding_spaces WHERE model_key = $1 FOR SHARE", model_key
    )
    if connection_id is not None and await connection.fetchval(_MAY_COMMIT, connection_id, model_key) is False:
        raise RetiredSpaceError(model_key, connection_id)
    if row is None:
        await connection.execute(_CREATE_LOCK)
        return (await _ensure_space(connection, model_key, dimension)).table
    if row["status"] == "retired":
        raise RetiredSpaceError(model_key)
    if row["dimension"] != dimension:
        raise ValueError(f"{model_key} is stored with dimension {row['dimension']}, not {dimension}")
    return str(row["table_name"])


async def pin_space(connection: asyncpg.Connection, model_key: str, dimension: int, spec: dict[str, Any]) -> None:
    """Make sure ``model_key`` has a space a connection can be pinned to (its table created again if
    retired, its spec stored so that every process can build its embedder). The caller's transaction
    then sets ``connections.embedding_model_key``; the lock keeps a switch from dropping the space
    as unused in between."""
    await connection.execute(_CREATE_LOCK)
    await _ensure_space(connection, model_key, dimension)
    await connection.execute(
        "UPDATE embedding_spaces SET spec = $2::jsonb WHERE model_key = $1 AND spec IS NULL",
        model_key,
        json.dumps(spec),
    )


# Which chunks a re-index covers: those of one connection ($n), or, deployment-wide, those of the
# connections that follow the default space (not pinned to a model of their own).
# Returns the joins from chunks ``c`` and the WHERE clause, with its parameter numbered ``param``.
_MEMBER_JOINS = "JOIN documents d ON d.id = c.document_id JOIN connections k ON k.id = d.connection_id"


def _members(connection_id: str | None, param: int) -> tuple[str, list[Any]]:
    if connection_id is None:
        return f"{_MEMBER_JOINS} WHERE k.embedding_model_key IS NULL", []
    return f"{_MEMBER_JOINS} WHERE k.id = ${param}", [connection_id]


async def drop_space_if_unused(connection: asyncpg.Connection, model_key: str) -> bool:
    """Drop the table of ``model_key`` when nothing uses it any more (``SpaceStore._drop_if_unused``):
    for the caller's transaction that has just unpinned or deleted the last connection pinned to it."""
    await connection.execute(_CREATE_LOCK)
    row = await connection.fetchrow("SELECT * FROM embedding_spaces WHERE model_key = $1 FOR UPDATE", model_key)
    if row is None or row["status"] == "retired":
        return False
    return await SpaceStore._drop_if_unused(connection, _space(row))


class SpaceStore:
    """The SQL of space roles, and of the re-index backfill and switch (deployment-wide or of one
    connection); the re-index runs themselves are rows of ``runs`` (``storage.runs``).

    Methods taking ``connection_id`` cover that connection's chunks when it is given, else the chunks
    of the connections following the default space (``_members``)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def active(self) -> EmbeddingSpace | None:
        row = await self._pool.fetchrow("SELECT * FROM embedding_spaces WHERE status = 'active'")
        return _space(row) if row is not None else None

    async def spaces(self) -> list[EmbeddingSpace]:
        """Every space, the active one first."""
        rows = await self._pool.fetch("SELECT * FROM embedding_spaces ORDER BY status = 'active' DESC, model_key")
        return [_space(row) for row in rows]

    async def set_fusion(self, model_key: str, fusion: dict[str, Any] | None) -> EmbeddingSpace | None:
        """Store the space's own fusion weights (None: back to the measured or deployment ones); None
        when there is no such space."""
        row = await self._pool.fetchrow(
            "UPDATE embedding_spaces SET fusion = $2::jsonb WHERE model_key = $1 RETURNING *",
            model_key,
            json.dumps(fusion) if fusion is not None else None,
        )
        return _space(row) if row is not None else None

    async def layout(self) -> tuple[EmbeddingSpace | None, dict[str, EmbeddingSpace]]:
        """The active space and the space of each pinned connection, in one statement."""
        rows = await self._pool.fetch(
            "SELECT s.*, k.id AS pinned_by FROM embedding_spaces s"
            " LEFT JOIN connections k ON k.embedding_model_key = s.model_key"
            " WHERE s.status = 'active' OR k.id IS NOT NULL"
        )
        active = next((_space(row) for row in rows if row["status"] == "active"), None)
        return active, {row["pinned_by"]: _space(row) for row in rows if row["pinned_by"] is not None}

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

    async def prepare_build(
        self, run_id: int, model_key: str, dimension: int, spec: dict[str, Any]
    ) -> tuple[EmbeddingSpace, str | None]:
        """Make ``model_key`` the building space, keeping the vectors it has (a resumed re-index skips
        them), and name it and the active one (returned) in run ``run_id``'s params. A different space
        left building by an abandoned re-index goes back to idle."""
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
            source = await connection.fetchval("SELECT model_key FROM embedding_spaces WHERE status = 'active'")
            await record_params(connection, run_id, {"source_key": source, "target_key": model_key})
            return _space(row), source

    async def prepare_connection_build(
        self, run_id: int, connection_id: str, model_key: str, dimension: int, spec: dict[str, Any], pin: bool
    ) -> tuple[EmbeddingSpace, str | None]:
        """The target space of a connection's re-index (created if need be, keeping the vectors it
        has) and the connection's current model. ``pin``: the connection is to be pinned to
        ``model_key``; else it is to follow the default again (``model_key`` is the active one).

        Both keys are named in run ``run_id``'s params in the same transaction, under the lock a switch
        takes before it drops a table nothing uses: a running re-index's target counts as used, so it
        is never dropped."""
        async with self._pool.acquire() as connection, connection.transaction():
            current = await connection.fetchrow(
                f"SELECT k.embedding_model_key AS pinned, {_EFFECTIVE} AS effective FROM connections k WHERE k.id = $1",
                connection_id,
            )
            if current is None:
                raise UnknownConnection(connection_id)
            if current["effective"] == model_key and (current["pinned"] is not None) == pin:
                raise ValueError(f"{model_key} is already the embedding model of connection {connection_id}")
            await pin_space(connection, model_key, dimension, spec)
            target = await connection.fetchrow("SELECT * FROM embedding_spaces WHERE model_key = $1", model_key)
            assert target is not None
            await record_params(connection, run_id, {"source_key": current["effective"], "target_key": model_key})
            return _space(target), current["effective"]

    async def connection_model(self, connection_id: str) -> tuple[str | None, str | None]:
        """The model the connection is pinned to (None: it follows the default) and the one it uses."""
        row = await self._pool.fetchrow(
            f"SELECT k.embedding_model_key AS pinned, {_EFFECTIVE} AS effective FROM connections k WHERE k.id = $1",
            connection_id,
        )
        if row is None:
            raise UnknownConnection(connection_id)
        return row["pinned"], row["effective"]

    async def count_chunks(self, connection_id: str | None = None) -> int:
        members, params = _members(connection_id, 1)
        return int(await self._pool.fetchval(f"SELECT count(*) FROM chunks c {members}", *params))

    async def count_vectors(self, table: str, connection_id: str | None = None) -> int:
        """Vectors in ``table`` of the chunks a re-index covers."""
        members, params = _members(connection_id, 1)
        return int(
            await self._pool.fetchval(
                f"SELECT count(*) FROM {identifier(table)} e JOIN chunks c ON c.id = e.chunk_id {members}", *params
            )
        )

    @staticmethod
    async def _missing(
        connection: asyncpg.Connection | asyncpg.Pool, table: str, after: str, limit: int, connection_id: str | None
    ) -> list[ChunkText]:
        members, params = _members(connection_id, 3)
        rows = await connection.fetch(
            f"SELECT c.id, d.title, c.heading, c.text FROM chunks c {members}"
            f" AND c.id > $1 AND NOT EXISTS (SELECT 1 FROM {identifier(table)} e WHERE e.chunk_id = c.id)"
            " ORDER BY c.id LIMIT $2",
            after,
            limit,
            *params,
        )
        return [ChunkText(row["id"], row["title"], row["heading"], row["text"]) for row in rows]

    async def embedded_chunks(
        self, table: str, document_id: str, texts: Sequence[str]
    ) -> list[tuple[ChunkText, Vectors]]:
        """The document's chunks of one of these ``texts`` that have a vector in ``table``, each with its
        vector (one row)."""
        rows = await self._pool.fetch(
            "SELECT c.id, d.title, c.heading, c.text, e.embedding FROM chunks c"
            f" JOIN documents d ON d.id = c.document_id JOIN {identifier(table)} e ON e.chunk_id = c.id"
            " WHERE c.document_id = $1 AND c.text = ANY($2::text[])",
            document_id,
            list(texts),
        )
        return [
            (ChunkText(row["id"], row["title"], row["heading"], row["text"]), row["embedding"].to_numpy())
            for row in rows
        ]

    async def missing(self, table: str, after: str, limit: int, connection_id: str | None = None) -> list[ChunkText]:
        """Chunks without a vector in ``table``, by id after ``after`` (keyset paging: each pass
        reads every chunk once, however many are added behind it)."""
        return await self._missing(self._pool, table, after, limit, connection_id)

    @staticmethod
    async def _store(connection: asyncpg.Connection, table: str, ids: Sequence[str], vectors: Vectors) -> None:
        # A chunk replaced by a newer version while it was embedded is gone: skip it, and try again
        # when its deletion committed between the EXISTS check and the foreign-key check (a savepoint
        # inside the switch's transaction, which the error would otherwise abort).
        while True:
            try:
                async with connection.transaction():
                    await connection.executemany(
                        f"INSERT INTO {identifier(table)} (chunk_id, embedding) SELECT $1, $2"
                        " WHERE EXISTS (SELECT 1 FROM chunks WHERE id = $1) ON CONFLICT (chunk_id) DO NOTHING",
                        list(zip(ids, list(vectors), strict=True)),
                    )
                return
            except asyncpg.ForeignKeyViolationError:
                continue

    async def store(self, table: str, ids: Sequence[str], vectors: Vectors) -> None:
        async with self._pool.acquire() as connection:
            await self._store(connection, table, ids, vectors)

    async def _backfill_rest(
        self,
        connection: asyncpg.Connection,
        table: str,
        connection_id: str | None,
        embed: Callable[[list[ChunkText]], Awaitable[Vectors]],
        batch: int,
    ) -> int:
        embedded, after = 0, ""
        while chunks := await self._missing(connection, table, after, batch, connection_id):
            await self._store(connection, table, [c.chunk_id for c in chunks], await embed(chunks))
            embedded += len(chunks)
            after = chunks[-1].chunk_id
        return embedded

    @staticmethod
    async def _drop_if_unused(connection: asyncpg.Connection, space: EmbeddingSpace) -> bool:
        """Retire ``space`` and drop its table when no connection is pinned to it, it is neither the
        active nor the building space, and no running re-index fills it; ``False`` when kept. The
        caller holds ``_CREATE_LOCK``, so no connection is pinned to it meanwhile (``pin_space``)."""
        used = await connection.fetchval(
            "SELECT EXISTS (SELECT 1 FROM connections WHERE embedding_model_key = $1)"
            " OR EXISTS (SELECT 1 FROM embedding_spaces WHERE model_key = $1 AND status IN ('active', 'building'))"
            " OR EXISTS (SELECT 1 FROM runs WHERE kind = 'reindex' AND params->>'target_key' = $1"
            " AND status = 'running')",
            space.model_key,
        )
        if used:
            return False
        await connection.execute(_SET_STATUS, space.model_key, "retired")
        # Dropping a table whose foreign key references chunks locks chunks exclusively too. Taken
        # first, in the order searches take them (SearchStore.snapshot: chunks, then an embedding
        # table), so a search in flight finishes instead of deadlocking with us.
        await connection.execute("LOCK TABLE chunks IN ACCESS EXCLUSIVE MODE")
        await connection.execute(f"DROP TABLE {identifier(space.table)}")
        return True

    async def switch(self, target_key: str, embed: Callable[[list[ChunkText]], Awaitable[Vectors]], batch: int) -> int:
        """Backfill what is still missing and make ``target_key`` active, in one transaction. The old
        active space is retired and its table dropped, unless connections are pinned to it: then it
        stays (idle) for them and only the followers' vectors leave it. Returns how many chunks were
        embedded here.

        The active and building rows are locked FOR UPDATE first: commits (``lock_space``) wait, so
        every chunk committed before the switch has a target vector and none commits to the old
        table after it. The caller leaves only the few chunks committed since its last pass."""
        async with self._pool.acquire() as connection, connection.transaction():
            # Before the rows: pinning a new connection takes it, then the space row (a foreign key).
            await connection.execute(_CREATE_LOCK)
            rows = await connection.fetch(
                "SELECT * FROM embedding_spaces WHERE status IN ('active', 'building') ORDER BY model_key FOR UPDATE"
            )
            spaces = {row["status"]: _space(row) for row in rows}
            target = spaces.get("building")
            if target is None or target.model_key != target_key:
                raise RuntimeError(f"{target_key} is no longer the building embedding space")
            embedded = await self._backfill_rest(connection, target.table, None, embed, batch)
            old = spaces.get("active")
            if old is not None:  # first: one active space at a time (a unique index)
                await connection.execute(_SET_STATUS, old.model_key, "idle")
            await connection.execute(_SET_STATUS, target_key, "active")
            if old is not None and not await self._drop_if_unused(connection, old):
                # Kept for the connections pinned to it: only theirs stay.
                await connection.execute(
                    f"DELETE FROM {identifier(old.table)} e USING chunks c {_MEMBER_JOINS}"
                    " WHERE e.chunk_id = c.id AND k.embedding_model_key IS DISTINCT FROM $1",
                    old.model_key,
                )
        return embedded

    async def switch_connection(
        self,
        connection_id: str,
        source_key: str | None,
        target_key: str,
        pin: bool,
        embedding: dict[str, Any] | None,
        embed: Callable[[list[ChunkText]], Awaitable[Vectors]],
        batch: int,
    ) -> int:
        """Backfill the connection's last chunks into ``target_key``'s table and switch the connection
        to it, in one transaction: pinned to it (``pin``) or following the default again, with
        ``embedding`` as its ``config.embedding`` (removed when ``None``). Its vectors leave the old
        table, which is dropped when nothing uses it any more. Returns how many chunks were embedded.

        Locks in the order commits take them: both space rows FOR SHARE (a deployment-wide switch,
        which locks them FOR UPDATE, cannot interleave), then the connection row FOR UPDATE, so
        commits of this connection in flight finish first and later ones see the new model."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute(_CREATE_LOCK)  # as ``switch``: before the rows
            rows = await connection.fetch(
                "SELECT * FROM embedding_spaces WHERE model_key = ANY($1::text[]) ORDER BY model_key FOR SHARE",
                [key for key in (source_key, target_key) if key is not None],
            )
            spaces = {row["model_key"]: _space(row) for row in rows}
            target = spaces.get(target_key)
            if target is None or target.status == "retired":
                raise RuntimeError(f"the table of {target_key} was dropped meanwhile")
            current = await connection.fetchrow(
                f"SELECT {_EFFECTIVE} AS effective FROM connections k WHERE k.id = $1 FOR UPDATE",
                connection_id,
            )
            if current is None:
                raise UnknownConnection(connection_id)
            if current["effective"] != source_key:
                raise RuntimeError(f"connection {connection_id} moved to {current['effective']} meanwhile")
            embedded = await self._backfill_rest(connection, target.table, connection_id, embed, batch)
            await connection.execute(
                "UPDATE connections SET embedding_model_key = $2, updated_at = now(),"
                " config = CASE WHEN $3::jsonb IS NULL THEN config - 'embedding'"
                "  ELSE config || jsonb_build_object('embedding', $3::jsonb) END WHERE id = $1",
                connection_id,
                target_key if pin else None,
                json.dumps(embedding) if embedding is not None else None,
            )
            old = spaces.get(source_key) if source_key is not None else None
            if old is not None and old.model_key != target_key and not await self._drop_if_unused(connection, old):
                await connection.execute(
                    f"DELETE FROM {identifier(old.table)} e USING chunks c, documents d"
                    " WHERE e.chunk_id = c.id AND d.id = c.document_id AND d.connection_id = $1",
                    connection_id,
                )
        return embedded

    @asynccontextmanager
    async def exclusive(self, connection_id: str | None = None) -> AsyncIterator[None]:
        """Hold the re-index lock for the block; ``ReindexBusy`` when another run holds it.

        A deployment-wide re-index holds the lock exclusively; one of a connection holds it shared
        plus that connection's own lock: re-indexes of different connections run side by side, and
        none while the deployment's runs."""
        async with self._pool.acquire() as connection:
            if connection_id is None:
                if not await connection.fetchval("SELECT pg_try_advisory_lock($1)", _REINDEX_LOCK):
                    raise ReindexBusy("a re-index is already running")
                locks = [("SELECT pg_advisory_unlock($1)", _REINDEX_LOCK)]
            else:
                if not await connection.fetchval("SELECT pg_try_advisory_lock_shared($1)", _REINDEX_LOCK):
                    raise ReindexBusy("a deployment-wide re-index is running")
                locks = [("SELECT pg_advisory_unlock_shared($1)", _REINDEX_LOCK)]
                if not await connection.fetchval(
                    "SELECT pg_try_advisory_lock($1, hashtext($2))", _CONNECTION_LOCK, connection_id
                ):
                    await connection.execute(*locks[0])
                    raise ReindexBusy(f"a re-index of connection {connection_id} is already running")
            try:
                yield
            finally:
                if connection_id is not None:
                    await connection.execute(
                        "SELECT pg_advisory_unlock($1, hashtext($2))", _CONNECTION_LOCK, connection_id
                    )
                for statement, key in locks:
                    await connection.execute(statement, key)
