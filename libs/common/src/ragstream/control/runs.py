"""Sync runs in PostgreSQL: start (one active run per connection), claim, progress, finish, read.

The database decides every race: the partial unique index ``sync_runs_one_active_idx`` makes a second
start a unique violation whichever replica asks, and claiming runs under a transaction-scoped
advisory lock so the concurrency limit holds across replicas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

import asyncpg

from ragstream.connectors.registry import ConnectionRow
from ragstream.storage.cursors import Direction

__all__ = [
    "ConnectionOverview",
    "RagDisabled",
    "RunCounts",
    "RunStatus",
    "SyncInProgress",
    "SyncRun",
    "SyncRunStore",
    "Trigger",
]

Trigger = Literal["api", "create", "schedule", "cli"]

# Serialises claims: count the running runs and take a queued one as one step. Any constant works.
_CLAIM_LOCK = 0x73796E63


class RunStatus(StrEnum):
    QUEUED = "queued"
    SYNCING = "syncing"
    READY = "ready"
    FAILED = "failed"


class RagDisabled(Exception):
    """The connection has RAG off (or is gone): it is served by direct search and nothing is indexed."""

    def __init__(self, connection_id: str) -> None:
        super().__init__(f"RAG is off for connection {connection_id}: turn rag_enabled on to index it")


class SyncInProgress(Exception):
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
    " listing_done = $9, direction = $10, resumed = $11, rate = $12, eta_seconds = $13"
)


def _count_args(counts: RunCounts) -> list[Any]:
    return [getattr(counts, name) for name in RunCounts.__dataclass_fields__]


class SyncRunStore:
    """Every read and write of ``sync_runs`` and the sync columns of ``connections``."""

    def __init__(self, pool: asyncpg.Pool, *, stale_timeout_s: float = 1800) -> None:
        self._pool = pool
        self._stale_timeout_s = stale_timeout_s

    async def connection(self, connection_id: str) -> ConnectionRow | None:
        row = await self._pool.fetchrow(
            "SELECT id, platform, name, config FROM connections WHERE id = $1", connection_id
        )
        return _connection(row) if row is not None else None

    async def set_schedule(self, connection_id: str, schedule_seconds: int) -> None:
        await self._pool.execute(
            "UPDATE connections SET schedule_seconds = $2, updated_at = now() WHERE id = $1",
            connection_id,
            schedule_seconds,
        )

    async def start(self, connection_id: str, trigger: Trigger, *, running: bool = False) -> SyncRun:
        """Queue a run. If one is active and silent past the stale timeout it is failed first;
        otherwise ``SyncInProgress`` (with the active run). ``RagDisabled`` when RAG is off.

        ``running`` starts it at once as syncing, outside the concurrency limit: a foreground
        ``ragstream ingest`` runs its own sync, and no runner may claim it in between."""
        for _ in range(2):
            try:
                row = await self._pool.fetchrow(
                    "INSERT INTO sync_runs (connection_id, trigger, status, started_at, heartbeat_at)"
                    " SELECT $1, $2, CASE WHEN $3::boolean THEN 'syncing' ELSE 'queued' END,"
                    " CASE WHEN $3 THEN now() END, CASE WHEN $3 THEN now() END"
                    " FROM connections WHERE id = $1 AND rag_enabled RETURNING *",
                    connection_id,
                    trigger,
                    running,
                )
                if row is None:
                    raise RagDisabled(connection_id)
                return SyncRun.from_row(row)
            except asyncpg.UniqueViolationError:
                if not await self.fail_stale(connection_id):
                    raise SyncInProgress(await self.active(connection_id)) from None
        raise SyncInProgress(await self.active(connection_id))

    async def fail_stale(self, connection_id: str | None = None) -> list[SyncRun]:
        """Fail running syncs (of one connection, or all) with no heartbeat for the stale timeout.

        Only running ones: a queued run waits for a free slot, which is not a sign of a dead sync."""
        async with self._pool.acquire() as connection, connection.transaction():
            rows = await connection.fetch(
                "UPDATE sync_runs SET status = 'failed', finished_at = now(), reason = 'stale: no progress for '"
                " || floor(extract(epoch FROM now() - coalesce(heartbeat_at, started_at, created_at)))::bigint || ' s'"
                " WHERE status = 'syncing' AND ($1::text IS NULL OR connection_id = $1)"
                " AND coalesce(heartbeat_at, started_at, created_at) < now() - make_interval(secs => $2)"
                " RETURNING *",
                connection_id,
                self._stale_timeout_s,
            )
            runs = [SyncRun.from_row(row) for row in rows]
            for run in runs:
                await self._set_sync_error(connection, run.connection_id, run.reason)
        return runs

    async def claim(self, max_concurrent: int) -> SyncRun | None:
        """Move the oldest queued run to syncing if fewer than ``max_concurrent`` runs are syncing."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock($1)", _CLAIM_LOCK)
            if await connection.fetchval("SELECT count(*) FROM sync_runs WHERE status = 'syncing'") >= max_concurrent:
                return None
            row = await connection.fetchrow(
                "UPDATE sync_runs SET status = 'syncing', started_at = now(), heartbeat_at = now()"
                " WHERE id = (SELECT id FROM sync_runs WHERE status = 'queued' ORDER BY id LIMIT 1) RETURNING *"
            )
        return SyncRun.from_row(row) if row is not None else None

    async def progress(
        self, run_id: int, counts: RunCounts, rate: float | None, eta_seconds: float | None, *, moved: bool
    ) -> bool:
        """Write the counters; the heartbeat moves only when ``moved`` (so a hung sync goes stale).
        False when the run is no longer syncing (failed as stale meanwhile)."""
        status = await self._pool.execute(
            f"UPDATE sync_runs SET {_COUNTS_SQL}, heartbeat_at = CASE WHEN $14 THEN now() ELSE heartbeat_at END"
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
                f"UPDATE sync_runs SET {_COUNTS_SQL}, status = $14, reason = $15, finished_at = now()"
                " WHERE id = $1 AND status IN ('queued', 'syncing') RETURNING *",
                run_id,
                *_count_args(counts),
                rate,
                None,
                status.value,
                reason,
            )
            if row is None:
                return None
            run = SyncRun.from_row(row)
            await self._set_sync_error(connection, run.connection_id, reason if status is RunStatus.FAILED else None)
        return run

    @staticmethod
    async def _set_sync_error(connection: asyncpg.Connection, connection_id: str, error: str | None) -> None:
        await connection.execute(
            "UPDATE connections SET sync_error = $2, updated_at = now() WHERE id = $1", connection_id, error
        )

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
        """Every connection with its latest run, for ``ragstream status``."""
        rows = await self._pool.fetch(
            "SELECT c.id AS c_id, c.platform, c.name, c.config, c.rag_enabled, c.schedule_seconds, c.sync_error,"
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
