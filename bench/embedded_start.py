"""Start, stop and restart times of the embedded PostgreSQL, and the schema's migrations on it.

Makes a fresh cluster in a temporary folder (under /var/tmp: as root the server runs as an
unprivileged account that must reach it), times ``EmbeddedPostgres.start()`` (initdb, configure,
start, ``CREATE EXTENSION vector``), ``apply_migrations``, ``stop()``, then ``--restarts`` times a
start and a stop of the existing cluster, which is what every CLI command pays. Prints the server
and pgvector versions, each time in ms, and the load average before and after.

    .venv/bin/python bench/embedded_start.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import asyncpg

from ragstream.storage.database import apply_migrations
from ragstream.storage.embedded_postgres import EmbeddedPostgres

__all__ = ["main"]


async def versions(dsn: str) -> str:
    connection = await asyncpg.connect(dsn)
    try:
        server = await connection.fetchval("SHOW server_version")
        vector = await connection.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        return f"PostgreSQL {server}, pgvector {vector}"
    finally:
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="ragstream-start-", dir="/var/tmp"))
    root.chmod(0o755)
    server = EmbeddedPostgres(root / "postgres")
    try:
        started = time.perf_counter()
        dsn = server.start()
        first = time.perf_counter() - started
        started = time.perf_counter()
        applied = asyncio.run(apply_migrations(dsn))
        migrations = time.perf_counter() - started
        label = asyncio.run(versions(dsn))
        started = time.perf_counter()
        server.stop()
        stop = time.perf_counter() - started
        restarts, stops = [], []
        for _ in range(args.restarts):
            started = time.perf_counter()
            server.start()
            restarts.append(time.perf_counter() - started)
            started = time.perf_counter()
            server.stop()
            stops.append(time.perf_counter() - started)
        print(
            f"{label}: first start {first * 1000:.0f} ms, {len(applied)} migrations {migrations * 1000:.0f} ms,"
            f" stop {stop * 1000:.0f} ms; restart {', '.join(f'{seconds * 1000:.0f}' for seconds in restarts)} ms;"
            f" its stop {', '.join(f'{seconds * 1000:.0f}' for seconds in stops)} ms;"
            f" load average before {load_before}, after {os.getloadavg()}"
        )
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
