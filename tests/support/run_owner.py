"""A process that owns one running sync and then does nothing: the liveness tests SIGKILL it.

Run as ``python -m tests.support.run_owner DSN CONNECTION_ID``; it prints the run's id once the run
is syncing (and owned), then sleeps until killed.
"""

from __future__ import annotations

import asyncio
import sys

import asyncpg

from ragstream.storage.database import connect_pool
from ragstream.storage.runs import OWNER_LOCK, RunStore

__all__ = ["main", "owner_locks"]


async def owner_locks(pool: asyncpg.Pool, run_id: int | None = None) -> int:
    """How many run owner locks (of one run, or all) are held in the pool's database. pg_locks lists
    every database of the server, and other advisory locks use two keys too: both are filtered."""
    count = await pool.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND classid::bigint = $1 AND ($2::bigint IS NULL OR objid::bigint = $2 % 2147483648)",
        OWNER_LOCK,
        run_id,
    )
    return int(count)


async def main(dsn: str, connection_id: str) -> None:
    pool = await connect_pool(dsn, max_size=2)
    runs = RunStore(pool, dsn)
    run = await runs.start(connection_id, "cli", running=True)
    sys.stdout.write(f"{run.id}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
