"""Connection pool and versioned schema migrations for PostgreSQL + pgvector."""

from __future__ import annotations

from importlib import resources

import asyncpg
from pgvector.asyncpg import register_vector

__all__ = ["apply_migrations", "connect_pool"]

# Any constant works; it only has to be the same in every process that migrates this database.
_MIGRATION_LOCK = 0x72616773


async def _init_connection(connection: asyncpg.Connection) -> None:
    await register_vector(connection)


async def connect_pool(dsn: str, *, min_size: int = 1, max_size: int = 8) -> asyncpg.Pool:
    """A pool whose connections know the ``vector`` type; migrations run first so that it exists."""
    await apply_migrations(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, init=_init_connection)
    assert pool is not None
    return pool


async def apply_migrations(dsn: str) -> list[str]:
    """Apply the numbered ``migrations/*.sql`` files not applied yet, each in its own transaction.

    An advisory lock serialises concurrent starts: five services booting at once against an empty
    database must not race to create the same tables.
    """
    files = sorted(
        (entry for entry in resources.files("ragstream.storage.migrations").iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    )
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
