"""Sync runs in PostgreSQL: start (one active run per connection), claim, progress, finish, read.

The database decides every race: the partial unique index ``sync_runs_one_active_idx`` makes a second
start a unique violation whichever replica asks, and claiming runs under a transaction-scoped
advisory lock so the concurrency limit holds across replicas.

Owner liveness needs no clock: the process that runs a sync holds a session-level advisory lock
keyed by the run's id on a connection of its own (``_RunOwner``), taken in the same transaction that
makes the run ``syncing``. PostgreSQL drops the lock the moment that session ends (the process was
killed, its host died, its connection dropped), so any replica can tell a run whose owner is gone
from ``pg_locks`` and fail it at once. The stale timeout remains for owners alive but hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

import asyncpg

from ragstream.connectors.registry import ConnectionRow
from ragstream.core.errors import Conflict
from ragstream.credentials import CredentialCipher
from ragstream.storage.cursors import Direction

__all__ = [
    "CONNECTION_ERRORS",
    "OWNER_GONE",
    "OWNER_LOCK",
    "ConnectionOverview",
    "Downstream",
    "RagDisabled",
    "RunCounts",
    "RunStatus",
    "SyncInProgress",
    "SyncRun",
    "SyncRunStore",
    "Trigger",
    "connect_session",
]

Trigger = Literal["api", "create", "schedule", "cli"]

# Serialises claims: count the running runs and take a queued one as one step. Any constant works.
_CLAIM_LOCK = 0x73796E63
# The first key of every owner lock (two-key form, so it never meets the one-key locks above); the
# second is the run id modulo 2**31, which is unique among the runs syncing at any one time. Public so
# that an operator or a test can find the owners in pg_locks (classid = OWNER_LOCK, objsubid = 2).
OWNER_LOCK = 0x72756E6F
OWNER_GONE = "owner gone: the process running this sync stopped or lost its database session"

# What a lost or failing database connection raises: callers that can retry later catch these.
CONNECTION_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)

# Runs syncing whose owner lock nobody holds. pg_locks lists every database of the server, hence the
# database filter; a lock taken in a committed transaction is visible to every session at once.
_ORPHANED = (
    "NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND l.classid::bigint = {OWNER_LOCK} AND l.objid::bigint = sync_runs.id % 2147483648)"
)
_SILENT = "coalesce(heartbeat_at, started_at, created_at) < now() - make_interval(secs => $2)"
_INSERT = (
    "INSERT INTO sync_runs (connection_id, trigger, status, started_at, heartbeat_at)"
    " SELECT $1, $2, CASE WHEN $3::boolean THEN 'syncing' ELSE 'queued' END,"
    " CASE WHEN $3 THEN now() END, CASE WHEN $3 THEN now() END"
    " FROM connections WHERE id = $1 AND rag_enabled RETURNING *"
)


async def connect_session(dsn: str) -> asyncpg.Connection:
    """A session of its own that may sit idle for hours (it holds advisory locks): the server's
    ``idle_session_timeout`` is switched off for it. With a SET rather than a startup parameter,
    which a session-mode PgBouncer would refuse; a server before PostgreSQL 14 has no such timeout."""
    connection = await asyncpg.connect(dsn)
    try:
        with contextlib.suppress(asyncpg.UndefinedObjectError):
            await connection.execute("SET idle_session_timeout = 0")
    except BaseException:
        await connection.close()
        raise
    return connection


class RunStatus(StrEnum):
    QUEUED = "queued"
    SYNCING = "syncing"
    READY = "ready"
    FAILED = "failed"


class RagDisabled(Conflict):
    """The connection has RAG off (or is gone): it is served by direct search and nothing is indexed."""

    def __init__(self, connection_id: str) -> None:
        super().__init__(f"RAG is off for connection {connection_id}: turn rag_enabled on to index it")


class SyncInProgress(Conflict):
    """The connection already has a queued or running sync that is not stale (the API's 409)."""

    def __init__(self, run: SyncRun | None) -> None:
        super().__init__("Sync already in progress")
        self.run = run


@dataclass(frozen=True, slots=True)
class RunCounts:
    """What a running sync has done so far, as written to its row, and which walk it is: backward
    (the first, full sync) or forward (incremental), and whether it resumed an interrupted one."""

    listed: int = 0
    unchanged: int = 0
    changed: int = 0
    indexed: int = 0
    deleted: int = 0
    failed: int = 0
    chunks: int = 0
    listing_done: bool = False
    direction: Direction | None = None
    resumed: bool = False
    # Entries the connector left out (symlinks, special files, unreadable ones): never indexed.
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class SyncRun:
    id: int
    connection_id: str
    trigger: str
    status: RunStatus
    reason: str | None
    counts: RunCounts
    rate: float | None
    eta_seconds: float | None
    created_at: datetime
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> SyncRun:
        return cls(
            id=row["id"],
            connection_id=row["connection_id"],
            trigger=row["trigger"],
            status=RunStatus(row["status"]),
            reason=row["reason"],
            counts=RunCounts(**{name: row[name] for name in RunCounts.__dataclass_fields__}),
            rate=row["rate"],
            eta_seconds=row["eta_seconds"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            heartbeat_at=row["heartbeat_at"],
            finished_at=row["finished_at"],
        )


@dataclass(frozen=True, slots=True)
class Downstream:
    """What the stages after the fetcher did with the changes a sync announced: in Kafka mode the
    run's indexed, failed and chunk counts come from here."""

    indexed: int
    failed: int
    chunks: int
    # Of the failed: those that failed at the embed step (the degradation guard's sample in Kafka mode).
    failed_embedding: int = 0

    def settled(self, announced: int) -> bool:
        """Every announced change is committed or failed for good."""
        return self.indexed + self.failed >= announced


@dataclass(frozen=True, slots=True)
class ConnectionOverview:
    """A connection with its latest run: one line of ``ragstream status``."""

    connection: ConnectionRow
    rag_enabled: bool
    schedule_seconds: int
    sync_error: str | None
    latest: SyncRun | None


def _connection(row: asyncpg.Record, id_column: str = "id") -> ConnectionRow:
    config = json.loads(row["config"]) if isinstance(row["config"], str) else row["config"]
    return ConnectionRow(id=row[id_column], platform=row["platform"], name=row["name"], config=dict(config or {}))


_COUNTS_SQL = (
    "listed = $2, unchanged = $3, changed = $4, indexed = $5, deleted = $6, failed = $7, chunks = $8,"
    " listing_done = $9, direction = $10, resumed = $11, skipped = $12, rate = $13, eta_seconds = $14"
)


def _count_args(counts: RunCounts) -> list[Any]:
    return [getattr(counts, name) for name in RunCounts.__dataclass_fields__]


def _owner_key(run_id: int) -> int:
    return run_id % 2147483648


class _RunOwner:
    """This process's own session, holding an advisory lock on each run it executes.

    Not a pooled connection: the pool resets a released connection (``pg_advisory_unlock_all``), and
    a lock must live exactly as long as this process can still finish its run. Opened on first use
    and again after it dropped (the runs it owned have been failed by then). One connection serves
    every run of the process, so its use is serialised. It must be a real session: DATABASE_URL may
    not point at a transaction-pooling proxy (PgBouncer in transaction mode), which would hand the
    lock to whichever client uses the server connection next."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._connection: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A transaction on the owner session; lock the runs it makes ``syncing`` with ``hold``."""
        async with self._lock:
            if self._connection is None or self._connection.is_closed():
                # The session sits idle while its runs sync: a server-wide idle_session_timeout
                # would end it, and every healthy run it owns would be failed as ownerless.
                self._connection = await connect_session(self._dsn)
            async with self._connection.transaction():
                yield self._connection

    @staticmethod
    async def hold(connection: asyncpg.Connection, run_id: int) -> None:
        """Lock a run inside the transaction that makes it syncing: once that commits, no session can
        see the run syncing without its lock held."""
        await connection.execute("SELECT pg_advisory_lock($1, $2)", OWNER_LOCK, _owner_key(run_id))

    async def release(self, run_id: int) -> None:
        """Unlock a run that has ended; nothing to do when the session is already gone."""
        async with self._lock:
            connection = self._connection
            if connection is None or connection.is_closed():
                return
            with contextlib.suppress(*CONNECTION_ERRORS):
                await connection.execute("SELECT pg_advisory_unlock($1, $2)", OWNER_LOCK, _owner_key(run_id))

    async def close(self) -> None:
        """End the session, and with it every lock: runs still held become visibly ownerless."""
        async with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                with contextlib.suppress(*CONNECTION_ERRORS):
                    await connection.close()


class SyncRunStore:
    """Every read and write of ``sync_runs`` and the sync columns of ``connections``.

    ``dsn`` is the pool's database: a run this store makes ``syncing`` (``claim``, a running
    ``start``) is owned by this store's session until ``finish``. Use one store per process and
    ``aclose`` it on shutdown. ``cipher`` decrypts a connection's credentials for its connector
    (``connection``); without one, a connection that has credentials cannot be synced
    (``CredentialKeyMissing``)."""

    def __init__(
        self, pool: asyncpg.Pool, dsn: str, *, stale_timeout_s: float = 1800, cipher: CredentialCipher | None = None
    ) -> None:
        self._pool = pool
        self._owner = _RunOwner(dsn)
        self._stale_timeout_s = stale_timeout_s
        self._cipher = cipher or CredentialCipher([])

    async def aclose(self) -> None:
        await self._owner.close()

    async def release(self, run_id: int) -> None:
        """Stop owning a run that ended without ``finish`` (failed elsewhere as stale): its lock
        would otherwise stay with this session until the process ends."""
        await self._owner.release(run_id)

    async def connection(self, connection_id: str) -> ConnectionRow | None:
        """The connection a run syncs, with its credentials decrypted for the connector."""
        row = await self._pool.fetchrow(
            "SELECT id, platform, name, config, credentials FROM connections WHERE id = $1", connection_id
        )
        if row is None:
            return None
        token = row["credentials"]
        credentials = self._cipher.decrypt(bytes(token)) if token is not None else {}
        return replace(_connection(row), credentials=credentials)

    async def set_schedule(self, connection_id: str, schedule_seconds: int) -> None:
        await self._pool.execute(
            "UPDATE connections SET schedule_seconds = $2, updated_at = now() WHERE id = $1",
            connection_id,
            schedule_seconds,
        )

    async def start(self, connection_id: str, trigger: Trigger, *, running: bool = False) -> SyncRun:
        """Queue a run. If the active one's owner is gone, or it is silent past the stale timeout, it
        is failed first; otherwise ``SyncInProgress`` (with the active run). ``RagDisabled`` when
        RAG is off.

        ``running`` starts it at once as syncing, owned by this store, outside the concurrency
        limit: a foreground ``ragstream ingest`` runs its own sync, and no runner may claim it in
        between."""
        for _ in range(2):
            try:
                row = await self._insert(connection_id, trigger, running)
                if row is None:
                    raise RagDisabled(connection_id)
                return SyncRun.from_row(row)
            except asyncpg.UniqueViolationError:
                if not await self.reap(connection_id):
                    raise SyncInProgress(await self.active(connection_id)) from None
        raise SyncInProgress(await self.active(connection_id))

    async def _insert(self, connection_id: str, trigger: Trigger, running: bool) -> asyncpg.Record | None:
        if not running:
            return await self._pool.fetchrow(_INSERT, connection_id, trigger, False)
        async with self._owner.transaction() as connection:
            row = await connection.fetchrow(_INSERT, connection_id, trigger, True)
            if row is not None:
                await self._owner.hold(connection, row["id"])
        return row

    async def reap(self, connection_id: str | None = None) -> list[SyncRun]:
        """Fail the syncing runs (of one connection, or all) whose owner is gone, then those silent
        past the stale timeout; the connection's ``sync_error`` says why.

        Only running ones: a queued run waits for a free slot, which is not a sign of a dead sync."""
        async with self._pool.acquire() as connection, connection.transaction():
            rows = await connection.fetch(
                "UPDATE sync_runs SET status = 'failed', finished_at = now(), reason = CASE WHEN"
                f" {_ORPHANED} THEN $3 ELSE 'stale: no progress for '"
                " || floor(extract(epoch FROM now() - coalesce(heartbeat_at, started_at, created_at)))::bigint"
                " || ' s' END"
                " WHERE status = 'syncing' AND ($1::text IS NULL OR connection_id = $1)"
                f" AND ({_ORPHANED} OR {_SILENT}) RETURNING *",
                connection_id,
                self._stale_timeout_s,
                OWNER_GONE,
            )
            runs = [SyncRun.from_row(row) for row in rows]
            for run in runs:
                await self._set_sync_error(connection, run.connection_id, run.reason)
        return runs

    async def claim(self, max_concurrent: int) -> SyncRun | None:
        """Move the oldest queued run to syncing, owned by this store, if fewer than
        ``max_concurrent`` runs are syncing."""
        async with self._owner.transaction() as connection:
            await connection.execute("SELECT pg_advisory_xact_lock($1)", _CLAIM_LOCK)
            if await connection.fetchval("SELECT count(*) FROM sync_runs WHERE status = 'syncing'") >= max_concurrent:
                return None
            row = await connection.fetchrow(
                "UPDATE sync_runs SET status = 'syncing', started_at = now(), heartbeat_at = now()"
                " WHERE id = (SELECT id FROM sync_runs WHERE status = 'queued' ORDER BY id LIMIT 1) RETURNING *"
            )
            if row is not None:
                await self._owner.hold(connection, row["id"])
        return SyncRun.from_row(row) if row is not None else None

    async def progress(
        self, run_id: int, counts: RunCounts, rate: float | None, eta_seconds: float | None, *, moved: bool
    ) -> bool:
        """Write the counters; the heartbeat moves only when ``moved`` (so a hung sync goes stale).
        False when the run is no longer syncing (failed as stale meanwhile)."""
        status = await self._pool.execute(
            f"UPDATE sync_runs SET {_COUNTS_SQL}, heartbeat_at = CASE WHEN $15 THEN now() ELSE heartbeat_at END"
            " WHERE id = $1 AND status = 'syncing'",
            run_id,
            *_count_args(counts),
            rate,
            eta_seconds,
            moved,
        )
        return bool(status != "UPDATE 0")

    async def finish(
        self,
        run_id: int,
        status: RunStatus,
        reason: str | None,
        counts: RunCounts,
        rate: float | None,
    ) -> SyncRun | None:
        """End an active run and set (failed) or clear (ready) the connection's ``sync_error``.

        None when the run was no longer active: a run already failed as stale stays failed."""
        if status not in (RunStatus.READY, RunStatus.FAILED):
            raise ValueError(f"a run finishes ready or failed, not {status}")
        async with self._pool.acquire() as connection, connection.transaction():
            row = await connection.fetchrow(
                f"UPDATE sync_runs SET {_COUNTS_SQL}, status = $15, reason = $16, finished_at = now()"
                " WHERE id = $1 AND status IN ('queued', 'syncing') RETURNING *",
                run_id,
                *_count_args(counts),
                rate,
                None,
                status.value,
                reason,
            )
            run = SyncRun.from_row(row) if row is not None else None
            if run is not None:
                await self._set_sync_error(
                    connection, run.connection_id, reason if status is RunStatus.FAILED else None
                )
        # After the commit: a run seen syncing always has its lock, so nobody fails it as ownerless.
        await self._owner.release(run_id)
        return run

    @staticmethod
    async def _set_sync_error(connection: asyncpg.Connection, connection_id: str, error: str | None) -> None:
        await connection.execute(
            "UPDATE connections SET sync_error = $2, updated_at = now() WHERE id = $1", connection_id, error
        )

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

    async def sync_error(self, connection_id: str) -> str | None:
        """Why the latest sync failed, if it did, then the documents that did not index by code."""
        error = await self._pool.fetchval("SELECT connection_sync_error($1)", connection_id)
        return str(error) if error is not None else None

    async def get(self, run_id: int) -> SyncRun | None:
        row = await self._pool.fetchrow("SELECT * FROM sync_runs WHERE id = $1", run_id)
        return SyncRun.from_row(row) if row is not None else None

    async def active(self, connection_id: str) -> SyncRun | None:
        row = await self._pool.fetchrow(
            "SELECT * FROM sync_runs WHERE connection_id = $1 AND status IN ('queued', 'syncing')", connection_id
        )
        return SyncRun.from_row(row) if row is not None else None

    async def latest(self, connection_id: str) -> SyncRun | None:
        runs = await self.runs(connection_id, limit=1)
        return runs[0] if runs else None

    async def runs(self, connection_id: str, *, limit: int = 20) -> list[SyncRun]:
        """The connection's runs, newest first."""
        rows = await self._pool.fetch(
            "SELECT * FROM sync_runs WHERE connection_id = $1 ORDER BY id DESC LIMIT $2", connection_id, limit
        )
        return [SyncRun.from_row(row) for row in rows]

    async def due(self) -> list[str]:
        """Connections whose schedule has come: RAG on, active, a schedule, no active run, and no run
        created within ``schedule_seconds`` (a connection never synced is due at once)."""
        rows = await self._pool.fetch(
            "SELECT c.id FROM connections c WHERE c.rag_enabled AND c.status = 'active' AND c.schedule_seconds > 0"
            " AND NOT EXISTS (SELECT 1 FROM sync_runs r WHERE r.connection_id = c.id"
            "  AND (r.status IN ('queued', 'syncing')"
            "   OR r.created_at > now() - make_interval(secs => c.schedule_seconds)))"
            " ORDER BY c.id"
        )
        return [row["id"] for row in rows]

    async def overview(self) -> list[ConnectionOverview]:
        """Every connection with its latest run, for ``ragstream status``; runs whose owner is gone
        (or stale) are failed first, so the status never shows a dead sync as syncing."""
        await self.reap()
        rows = await self._pool.fetch(
            "SELECT c.id AS c_id, c.platform, c.name, c.config, c.rag_enabled, c.schedule_seconds,"
            " connection_sync_error(c.id) AS sync_error,"
            " r.* FROM connections c LEFT JOIN LATERAL"
            " (SELECT * FROM sync_runs WHERE connection_id = c.id ORDER BY id DESC LIMIT 1) r ON true ORDER BY c.id"
        )
        return [
            ConnectionOverview(
                connection=_connection(row, "c_id"),
                rag_enabled=row["rag_enabled"],
                schedule_seconds=row["schedule_seconds"],
                sync_error=row["sync_error"],
                latest=SyncRun.from_row(row) if row["id"] is not None else None,
            )
            for row in rows
        ]
