"""Connection pool and versioned schema migrations for PostgreSQL + pgvector."""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import asyncpg
from asyncpg.pool import PoolAcquireContext
from pgvector.asyncpg import register_vector

from ragstream.core.errors import Unavailable
from ragstream.metrics import DB_POOL_WAIT

__all__ = [
    "DatabaseBusy",
    "DatabaseUnavailable",
    "apply_migrations",
    "close_pool",
    "connect_pool",
    "pending_migrations",
    "ping",
]

logger = logging.getLogger(__name__)

# Any constant works; it only has to be the same in every process that migrates this database.
_MIGRATION_LOCK = 0x72616773


async def _init_connection(connection: asyncpg.Connection) -> None:
    await register_vector(connection)


class DatabaseBusy(Unavailable, TimeoutError):
    """The database could not serve in time: no pool connection within the acquire timeout, or a
    statement cancelled by its ``statement_timeout``. Transient: the API answers 503 with Retry-After."""

    code = "database_busy"
    public_reason = "the database is busy"


class DatabaseUnavailable(Unavailable, ConnectionError):
    """The database is down for now (the embedded PostgreSQL being restarted); the message says why."""

    code = "database_unavailable"
    public_reason = "the database is unavailable"


class _BoundedAcquire(PoolAcquireContext):  # type: ignore[misc]  # asyncpg ships no types
    """``Pool.acquire`` whose timeout becomes :class:`DatabaseBusy`."""

    __slots__ = ()

    async def __aenter__(self) -> Any:
        try:
            with DB_POOL_WAIT.time():
                return await super().__aenter__()
        except TimeoutError:
            raise DatabaseBusy(f"no database connection free within {self.timeout} s") from None

    def __await__(self) -> Any:
        return self.__aenter__().__await__()


class _BoundedPool(asyncpg.Pool):  # type: ignore[misc]  # asyncpg ships no types
    """A pool on which every wait for a connection has a timeout, ``acquire_timeout_s`` unless the
    caller gives its own. ``Pool.fetch``, ``fetchval``, ``execute`` and the rest acquire through
    ``acquire`` too, so none of them can wait for ever on an exhausted pool."""

    __slots__ = ("_acquire_timeout_s",)

    def __init__(self, dsn: str, *, acquire_timeout_s: float, **options: Any) -> None:
        super().__init__(dsn, **options)
        self._acquire_timeout_s = acquire_timeout_s

    def acquire(self, *, timeout: float | None = None) -> PoolAcquireContext:
        return _BoundedAcquire(self, self._acquire_timeout_s if timeout is None else timeout)


async def connect_pool(
    dsn: str, *, min_size: int = 1, max_size: int = 8, acquire_timeout_s: float = 5.0
) -> asyncpg.Pool:
    """A pool whose connections know the ``vector`` type, and whose every acquire waits at most
    ``acquire_timeout_s`` (then :class:`DatabaseBusy`); migrations run first so that the type exists."""
    await apply_migrations(dsn)
    # asyncpg.create_pool with its defaults, but the pool class that bounds every acquire.
    pool = _BoundedPool(
        dsn,
        acquire_timeout_s=acquire_timeout_s,
        min_size=min_size,
        max_size=max_size,
        max_queries=50_000,
        max_inactive_connection_lifetime=300.0,
        init=_init_connection,
        loop=None,
        connection_class=asyncpg.Connection,
        record_class=asyncpg.Record,
    )
    await pool
    return pool


async def ping(pool: asyncpg.Pool, timeout_s: float) -> None:
    """A round trip to the database through the pool, within ``timeout_s`` for the acquire and the
    statement each: :class:`DatabaseBusy` when the pool gives no connection in time."""
    async with pool.acquire(timeout=timeout_s) as connection:
        await connection.fetchval("SELECT true", timeout=timeout_s)


async def close_pool(pool: asyncpg.Pool, timeout_s: float) -> None:
    """Close ``pool`` gracefully, waiting at most ``timeout_s`` for connections still in use; then
    terminate them (their transactions roll back), so that a stuck caller cannot hold up shutdown."""
    try:
        async with asyncio.timeout(timeout_s):
            await pool.close()
    except TimeoutError:
        logger.warning("database connections still in use after %s s: terminating them", timeout_s)
        pool.terminate()


def _migration_files() -> list[Traversable]:
    return sorted(
        (entry for entry in resources.files("ragstream.storage.migrations").iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    )


async def pending_migrations(dsn: str) -> list[str]:
    """The migrations this build knows that the database has not applied yet (none applied: all)."""
    connection = await asyncpg.connect(dsn)
    try:
        if await connection.fetchval("SELECT to_regclass('schema_migrations') IS NULL"):
            done: set[str] = set()
        else:
            done = {row["name"] for row in await connection.fetch("SELECT name FROM schema_migrations")}
    finally:
        await connection.close()
    return [entry.name for entry in _migration_files() if entry.name not in done]


async def apply_migrations(dsn: str, *, through: str | None = None) -> list[str]:
    """Apply the numbered ``migrations/*.sql`` files not applied yet, each in its own transaction;
    with ``through``, only those up to that file name (a database left at an older schema).

    An advisory lock serialises concurrent starts: five services booting at once against an empty
    database must not race to create the same tables.
    """
    files = [entry for entry in _migration_files() if through is None or entry.name <= through]
    connection = await asyncpg.connect(dsn)
    applied: list[str] = []
    try:
        await connection.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row["name"] for row in await connection.fetch("SELECT name FROM schema_migrations")}
        for entry in files:
            if entry.name in done:
                continue
            async with connection.transaction():
                await connection.execute(entry.read_text(encoding="utf-8"))
                await connection.execute("INSERT INTO schema_migrations (name) VALUES ($1)", entry.name)
            applied.append(entry.name)
    finally:
        await connection.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
        await connection.close()
    return applied
