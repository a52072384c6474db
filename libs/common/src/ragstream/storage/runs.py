"""Runs in PostgreSQL (migration 0021): start (one active run per kind and scope), claim, heartbeat and
progress, cancel requests, finish, read; and the sync columns of ``connections`` a sync run sets.

The database decides every race: the partial unique index ``runs_one_active_idx`` makes a second
start a unique violation whichever replica asks, and claiming runs under a transaction-scoped
advisory lock so the concurrency limit of each kind holds across replicas.

Owner liveness needs no clock: the process that runs a job holds a session-level advisory lock keyed
by the run's id on a connection of its own (``_RunOwner``), taken in the same transaction that makes
the run ``running``. PostgreSQL drops the lock the moment that session ends (the process was killed,
its host died, its connection dropped), so any replica can tell a run whose owner is gone from
``pg_locks`` and fail it at once. The stale timeout remains for owners alive but hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

import asyncpg

from ragstream.core.errors import Conflict
from ragstream.credentials import CredentialCipher
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.run_params import RunKind, json_object
from ragstream.storage.spaces import UnknownConnection

__all__ = [
    "CONNECTION_ERRORS",
    "OWNER_GONE",
    "OWNER_LOCK",
    "ConnectionOverview",
    "Heartbeat",
    "RagDisabled",
    "Run",
    "RunInProgress",
    "RunKind",
    "RunStatus",
    "RunStore",
    "Trigger",
    "connect_session",
    "still_leading",
    "try_lead",
]

Trigger = Literal["api", "create", "schedule", "cli"]

# Serialises claims: count the running runs and take a queued one as one step. Any constant works.
_CLAIM_LOCK = 0x73796E63
# Serialises the starts of re-index runs, so that the check below and the insert are one step.
_REINDEX_START_LOCK = 0x72656978
# A deployment-wide re-index and a connection's exclude each other (both move that connection's
# vectors): the active re-index, of another scope, that a start of scope $1 must wait for.
_CONFLICTING_REINDEX = (
    "SELECT * FROM runs WHERE kind = 'reindex' AND status IN ('queued', 'running')"
    " AND connection_id IS DISTINCT FROM $1 AND ($1::text IS NULL OR connection_id IS NULL) LIMIT 1"
)
# The first key of every owner lock (two-key form, so it never meets the one-key locks above); the
# second is the run id modulo 2**31, which is unique among the runs running at any one time. Public so
# that an operator or a test can find the owners in pg_locks (classid = OWNER_LOCK, objsubid = 2).
OWNER_LOCK = 0x72756E6F
OWNER_GONE = "owner gone: the process running this job stopped or lost its database session"

# What a lost or failing database connection raises: callers that can retry later catch these.
CONNECTION_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)

_ACTIVE = "status IN ('queued', 'running')"
# Runs running whose owner lock nobody holds. pg_locks lists every database of the server, hence the
# database filter; a lock taken in a committed transaction is visible to every session at once.
_ORPHANED = (
    "NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND l.classid::bigint = {OWNER_LOCK} AND l.objid::bigint = runs.id % 2147483648)"
)
_SILENT = "coalesce(heartbeat_at, started_at, created_at) < now() - make_interval(secs => $2)"
# A sync needs its connection with RAG on; the other kinds need it to exist (or none: the deployment).
_INSERT = (
    "INSERT INTO runs (kind, connection_id, trigger, params, status, owner, started_at, heartbeat_at)"
    " SELECT $1, $2, $3, $4::jsonb, CASE WHEN $5::boolean THEN 'running' ELSE 'queued' END,"
    " CASE WHEN $5 THEN $6 END, CASE WHEN $5 THEN now() END, CASE WHEN $5 THEN now() END"
    " WHERE $2::text IS NULL OR EXISTS (SELECT 1 FROM connections c WHERE c.id = $2"
    "  AND (c.rag_enabled OR $1 <> 'sync'))"
    " RETURNING *"
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


async def try_lead(dsn: str, key: int) -> asyncpg.Connection | None:
    """A session of its own holding the advisory lock ``key`` for as long as it lives (a leadership
    among replicas), or None when another session holds it. Idle between uses: a server
    ``idle_session_timeout`` must not end it (``connect_session``)."""
    connection = await connect_session(dsn)
    try:
        if await connection.fetchval("SELECT pg_try_advisory_lock($1)", key):
            return connection
    except BaseException:
        await connection.close()
        raise
    await connection.close()
    return None


async def still_leading(connection: asyncpg.Connection) -> bool:
    """False when the session that held a leadership is gone (and with it the lock)."""
    if connection.is_closed():
        return False
    try:
        await connection.fetchval("SELECT 1")
    except CONNECTION_ERRORS:
        return False
    return True


class RunStatus(StrEnum):
    """One vocabulary for every kind: queued and running are active, the others final."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RagDisabled(Conflict):
    """The connection has RAG off (or is gone): it is served by direct search and nothing is indexed."""

    def __init__(self, connection_id: str) -> None:
        super().__init__(f"RAG is off for connection {connection_id}: turn rag_enabled on to index it")


class RunInProgress(Conflict):
    """The scope already has a queued or running run of this kind that is not stale, or, for a re-index,
    one of the deployment runs beside a connection's (the API's 409)."""

    def __init__(self, kind: str, run: Run | None) -> None:
        super().__init__("Sync already in progress" if kind == "sync" else f"a {kind} run is already in progress")
        self.run = run


@dataclass(frozen=True, slots=True)
class Run:
    """A run as its row stores it; ``progress`` is the document the job's progress writes."""

    id: int
    kind: str
    connection_id: str | None
    trigger: str
    status: RunStatus
    params: dict[str, Any]
    progress: dict[str, Any]
    error: str | None
    cancel_requested: bool
    owner: str | None
    created_at: datetime
    started_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None

    @property
    def active(self) -> bool:
        return self.status in (RunStatus.QUEUED, RunStatus.RUNNING)

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> Run:
        return cls(
            id=row["id"],
            kind=row["kind"],
            connection_id=row["connection_id"],
            trigger=row["trigger"],
            status=RunStatus(row["status"]),
            params=json_object(row["params"]),
            progress=json_object(row["progress"]),
            error=row["error"],
            cancel_requested=row["cancel_requested"],
            owner=row["owner"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            heartbeat_at=row["heartbeat_at"],
            finished_at=row["finished_at"],
        )


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What the owner learns when it writes a running run's progress."""

    # False: the run is no longer running (failed elsewhere as stale or ownerless).
    running: bool
    cancel_requested: bool = False


@dataclass(frozen=True, slots=True)
class ConnectionOverview:
    """A connection with its latest sync run: one line of ``ragstream status``."""

    connection_id: str
    platform: str
    name: str
    rag_enabled: bool
    schedule_seconds: int
    sync_error: str | None
    latest: Run | None


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
        """A transaction on the owner session; lock the runs it makes ``running`` with ``hold``."""
        async with self._lock:
            if self._connection is None or self._connection.is_closed():
                # The session sits idle while its runs run: a server-wide idle_session_timeout
                # would end it, and every healthy run it owns would be failed as ownerless.
                self._connection = await connect_session(self._dsn)
            async with self._connection.transaction():
                yield self._connection

    @staticmethod
    async def hold(connection: asyncpg.Connection, run_id: int) -> None:
        """Lock a run inside the transaction that makes it running: once that commits, no session can
        see the run running without its lock held."""
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


class RunStore:
    """Every read and write of ``runs``, and of the sync columns of ``connections``.

    ``dsn`` is the pool's database: a run this store makes ``running`` (``claim``, a running
    ``start``) is owned by this store's session until ``finish``. Use one store per process and
    ``aclose`` it on shutdown. ``connections`` reads the connection a sync builds its connector from,
    with ``cipher`` decrypting its credentials; without one, a connection that has credentials cannot
    be synced (``CredentialKeyMissing``)."""

    def __init__(
        self, pool: asyncpg.Pool, dsn: str, *, stale_timeout_s: float = 1800, cipher: CredentialCipher | None = None
    ) -> None:
        self._pool = pool
        self._owner = _RunOwner(dsn)
        self._stale_timeout_s = stale_timeout_s
        self.connections = ConnectionStore(pool, cipher or CredentialCipher([]))
        self.owner_name = f"{socket.gethostname()}:{os.getpid()}"

    async def aclose(self) -> None:
        await self._owner.close()

    async def release(self, run_id: int) -> None:
        """Stop owning a run that ended without ``finish`` (failed elsewhere as stale): its lock
        would otherwise stay with this session until the process ends."""
        await self._owner.release(run_id)

    async def set_schedule(self, connection_id: str, schedule_seconds: int) -> None:
        await self._pool.execute(
            "UPDATE connections SET schedule_seconds = $2, updated_at = now() WHERE id = $1",
            connection_id,
            schedule_seconds,
        )

    async def start(
        self,
        connection_id: str | None,
        trigger: Trigger,
        *,
        kind: RunKind = "sync",
        params: Mapping[str, Any] | None = None,
        running: bool = False,
    ) -> Run:
        """Queue a run of ``kind`` for the connection (None: the deployment). If the active one's owner
        is gone, or it is silent past the stale timeout, it is failed first; otherwise
        ``RunInProgress`` (with the active run). ``RagDisabled`` when a sync's connection has RAG off
        or is gone, ``UnknownConnection`` when another kind's connection is gone.

        ``running`` starts it at once, owned by this store, outside the concurrency limit: a
        foreground ``ragstream ingest`` runs its own sync, and no runner may claim it in between."""
        if kind == "sync" and connection_id is None:
            raise ValueError("a sync run needs a connection")
        document = json.dumps(dict(params or {}))
        for _ in range(2):
            try:
                row = await self._insert(kind, connection_id, trigger, document, running)
            except asyncpg.UniqueViolationError:
                if not await self.reap(connection_id, kind=kind):
                    raise RunInProgress(kind, await self.active(connection_id, kind=kind)) from None
                continue
            if row is not None:
                return Run.from_row(row)
            if kind == "sync" and connection_id is not None:
                raise RagDisabled(connection_id)
            raise UnknownConnection(f"connection {connection_id} not found")
        raise RunInProgress(kind, await self.active(connection_id, kind=kind))

    async def _insert(
        self, kind: RunKind, connection_id: str | None, trigger: Trigger, params: str, running: bool
    ) -> asyncpg.Record | None:
        """Insert the run in one transaction: the owner session's when it starts ``running`` (its lock
        taken in the same transaction), a pooled one's otherwise. A re-index refused by one of another
        scope raises ``RunInProgress``."""
        args = (kind, connection_id, trigger, params, running, self.owner_name)
        transaction = self._owner.transaction() if running else self._pooled_transaction()
        async with transaction as connection:
            if kind == "reindex":
                await connection.execute("SELECT pg_advisory_xact_lock($1)", _REINDEX_START_LOCK)
                conflicting = await connection.fetchrow(_CONFLICTING_REINDEX, connection_id)
                if conflicting is not None:
                    raise RunInProgress(kind, Run.from_row(conflicting))
            row = await connection.fetchrow(_INSERT, *args)
            if row is not None and running:
                await self._owner.hold(connection, row["id"])
        return row

    @contextlib.asynccontextmanager
    async def _pooled_transaction(self) -> AsyncIterator[asyncpg.Connection]:
        async with self._pool.acquire() as connection, connection.transaction():
            yield connection

    async def reap(self, connection_id: str | None = None, *, kind: RunKind | None = None) -> list[Run]:
        """Fail the running runs (of one connection and kind, or all) whose owner is gone, then those
        silent past the stale timeout; a sync's connection ``sync_error`` says why.

        Only running ones: a queued run waits for a free slot, which is not a sign of a dead job."""
        async with self._pool.acquire() as connection, connection.transaction():
            rows = await connection.fetch(
                "UPDATE runs SET status = 'failed', finished_at = now(), error = CASE WHEN"
                f" {_ORPHANED} THEN $3 ELSE 'stale: no progress for '"
                " || floor(extract(epoch FROM now() - coalesce(heartbeat_at, started_at, created_at)))::bigint"
                " || ' s' END"
                " WHERE status = 'running' AND ($1::text IS NULL OR connection_id = $1)"
                " AND ($4::text IS NULL OR kind = $4)"
                f" AND ({_ORPHANED} OR {_SILENT}) RETURNING *",
                connection_id,
                self._stale_timeout_s,
                OWNER_GONE,
                kind,
            )
            runs = [Run.from_row(row) for row in rows]
            for run in runs:
                await self._set_sync_error(connection, run, run.error)
        return runs

    async def claim(self, max_concurrent: int, kinds: Collection[str]) -> Run | None:
        """Move the oldest queued run of one of ``kinds`` to running, owned by this store, if fewer
        than ``max_concurrent`` runs of its kind are running."""
        async with self._owner.transaction() as connection:
            await connection.execute("SELECT pg_advisory_xact_lock($1)", _CLAIM_LOCK)
            row = await connection.fetchrow(
                "UPDATE runs SET status = 'running', started_at = now(), heartbeat_at = now(), owner = $3"
                " WHERE id = (SELECT q.id FROM runs q WHERE q.status = 'queued' AND q.kind = ANY($1::text[])"
                "  AND (SELECT count(*) FROM runs r WHERE r.status = 'running' AND r.kind = q.kind) < $2"
                "  ORDER BY q.id LIMIT 1)"
                # Checked again on the locked row: a cancel committed since the subquery read it wins.
                " AND status = 'queued' RETURNING *",
                list(kinds),
                max_concurrent,
                self.owner_name,
            )
            if row is not None:
                await self._owner.hold(connection, row["id"])
        return Run.from_row(row) if row is not None else None

    async def progress(self, run_id: int, document: Mapping[str, Any], *, moved: bool) -> Heartbeat:
        """Write the progress document; the heartbeat moves only when ``moved`` (so a hung job goes
        stale). Says whether the run is still running and whether a cancel was asked for."""
        requested = await self._pool.fetchval(
            "UPDATE runs SET progress = $2::jsonb, heartbeat_at = CASE WHEN $3 THEN now() ELSE heartbeat_at END"
            " WHERE id = $1 AND status = 'running' RETURNING cancel_requested",
            run_id,
            json.dumps(dict(document)),
            moved,
        )
        return Heartbeat(running=requested is not None, cancel_requested=bool(requested))

    async def finish(
        self, run_id: int, status: RunStatus, error: str | None, document: Mapping[str, Any]
    ) -> Run | None:
        """End an active run; a sync's connection ``sync_error`` is set (failed) or cleared (succeeded).

        None when the run was no longer active: a run already failed as stale stays failed."""
        if status not in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED):
            raise ValueError(f"a run finishes succeeded, failed or cancelled, not {status}")
        async with self._pool.acquire() as connection, connection.transaction():
            row = await connection.fetchrow(
                "UPDATE runs SET progress = $2::jsonb, status = $3, error = $4, finished_at = now(),"
                f" heartbeat_at = now() WHERE id = $1 AND {_ACTIVE} RETURNING *",
                run_id,
                json.dumps(dict(document)),
                status.value,
                error,
            )
            run = Run.from_row(row) if row is not None else None
            if run is not None:
                await self._set_sync_error(connection, run, None if status is RunStatus.SUCCEEDED else error)
        # After the commit: a run seen running always has its lock, so nobody fails it as ownerless.
        await self._owner.release(run_id)
        return run

    async def request_cancel(self, run_id: int) -> Run | None:
        """Ask for a run to stop, from any process: a queued run is cancelled at once, a running one
        is marked and its owner cancels it at its next heartbeat. None when no such run; a finished
        run is returned as it is."""
        async with self._pool.acquire() as connection, connection.transaction():
            row = await connection.fetchrow(
                "UPDATE runs SET status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END,"
                " finished_at = CASE WHEN status = 'queued' THEN now() ELSE finished_at END,"
                " error = CASE WHEN status = 'queued' THEN 'cancelled on request' ELSE error END,"
                f" cancel_requested = true WHERE id = $1 AND {_ACTIVE} RETURNING *",
                run_id,
            )
            if row is None:
                row = await connection.fetchrow("SELECT * FROM runs WHERE id = $1", run_id)
        return Run.from_row(row) if row is not None else None

    @staticmethod
    async def _set_sync_error(connection: asyncpg.Connection, run: Run, error: str | None) -> None:
        """A sync sets (or clears) its connection's ``sync_error``; other kinds leave it."""
        if run.kind != "sync" or run.connection_id is None:
            return
        await connection.execute(
            "UPDATE connections SET sync_error = $2, updated_at = now() WHERE id = $1", run.connection_id, error
        )

    async def sync_error(self, connection_id: str) -> str | None:
        """Why the latest sync failed, if it did, then the documents that did not index by code."""
        error = await self._pool.fetchval("SELECT connection_sync_error($1)", connection_id)
        return str(error) if error is not None else None

    async def get(self, run_id: int) -> Run | None:
        row = await self._pool.fetchrow("SELECT * FROM runs WHERE id = $1", run_id)
        return Run.from_row(row) if row is not None else None

    async def active_of_kind(self, kind: RunKind) -> list[Run]:
        """The queued or running runs of ``kind``, of every scope, oldest first."""
        rows = await self._pool.fetch(f"SELECT * FROM runs WHERE kind = $1 AND {_ACTIVE} ORDER BY id", kind)
        return [Run.from_row(row) for row in rows]

    async def active(self, connection_id: str | None, *, kind: RunKind = "sync") -> Run | None:
        row = await self._pool.fetchrow(
            f"SELECT * FROM runs WHERE kind = $1 AND connection_id IS NOT DISTINCT FROM $2 AND {_ACTIVE}",
            kind,
            connection_id,
        )
        return Run.from_row(row) if row is not None else None

    async def latest(self, connection_id: str | None, *, kind: RunKind = "sync") -> Run | None:
        """The latest run of ``kind`` of the connection (None: of the deployment)."""
        row = await self._pool.fetchrow(
            "SELECT * FROM runs WHERE kind = $1 AND connection_id IS NOT DISTINCT FROM $2 ORDER BY id DESC LIMIT 1",
            kind,
            connection_id,
        )
        return Run.from_row(row) if row is not None else None

    async def runs(self, connection_id: str | None = None, *, kind: str | None = "sync", limit: int = 20) -> list[Run]:
        """Runs newest first, of one connection and of one kind when given (None: any)."""
        rows = await self._pool.fetch(
            "SELECT * FROM runs WHERE ($1::text IS NULL OR connection_id = $1) AND ($2::text IS NULL OR kind = $2)"
            " ORDER BY id DESC LIMIT $3",
            connection_id,
            kind,
            limit,
        )
        return [Run.from_row(row) for row in rows]

    async def due(self) -> list[str]:
        """Connections whose schedule has come: RAG on, active, a schedule, no active sync, and no
        sync created within ``schedule_seconds`` (a connection never synced is due at once)."""
        rows = await self._pool.fetch(
            "SELECT c.id FROM connections c WHERE c.rag_enabled AND c.status = 'active' AND c.schedule_seconds > 0"
            " AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.kind = 'sync' AND r.connection_id = c.id"
            "  AND (r.status IN ('queued', 'running')"
            "   OR r.created_at > now() - make_interval(secs => c.schedule_seconds)))"
            " ORDER BY c.id"
        )
        return [row["id"] for row in rows]

    async def overview(self) -> list[ConnectionOverview]:
        """Every connection with its latest sync, for ``ragstream status``; runs whose owner is gone
        (or stale) are failed first, so the status never shows a dead sync as running."""
        await self.reap()
        rows = await self._pool.fetch(
            "SELECT c.id AS c_id, c.platform, c.name, c.rag_enabled, c.schedule_seconds,"
            " connection_sync_error(c.id) AS sync_error,"
            " r.* FROM connections c LEFT JOIN LATERAL"
            " (SELECT * FROM runs WHERE kind = 'sync' AND connection_id = c.id ORDER BY id DESC LIMIT 1) r ON true"
            " ORDER BY c.id"
        )
        return [
            ConnectionOverview(
                connection_id=row["c_id"],
                platform=row["platform"],
                name=row["name"],
                rag_enabled=row["rag_enabled"],
                schedule_seconds=row["schedule_seconds"],
                sync_error=row["sync_error"],
                latest=Run.from_row(row) if row["id"] is not None else None,
            )
            for row in rows
        ]
