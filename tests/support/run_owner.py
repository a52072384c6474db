"""A process that owns one running sync and then does nothing: the liveness tests SIGKILL it.

Run as ``python -m tests.support.run_owner DSN CONNECTION_ID``; it prints the run's id once the run
is syncing (and owned), then sleeps until killed.
"""

from __future__ import annotations

import asyncio
import sys

from ragstream.control.runs import SyncRunStore
from ragstream.storage.database import connect_pool

__all__ = ["main"]


async def main(dsn: str, connection_id: str) -> None:
    pool = await connect_pool(dsn, max_size=2)
    runs = SyncRunStore(pool, dsn)
    run = await runs.start(connection_id, "cli", running=True)
    sys.stdout.write(f"{run.id}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
