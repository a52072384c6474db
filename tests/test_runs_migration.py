"""Migration 0021 upgrades a database in place: the rows of the old run tables become runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import asyncpg
import pytest

from ragstream.storage.database import apply_migrations
from ragstream.storage.runs import RunStore
from tests.support.connections import private_database


@pytest.fixture
async def old_dsn(database_url: str) -> AsyncIterator[str]:
    """A database at the schema before the runs table, with runs in the old tables."""
    async with private_database(database_url) as dsn:
        await apply_migrations(dsn, through="0020_space_fusion.sql")
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(
                "INSERT INTO connections (id, platform, name, config) VALUES ('wiki', 'folder', 'wiki', '{}')"
            )
            await connection.execute(
                "INSERT INTO sync_runs (id, connection_id, trigger, status, reason, listed, unchanged, changed,"
                " indexed, failed, chunks, listing_done, direction, skipped, rate, finished_at) VALUES"
                " (7, 'wiki', 'schedule', 'ready', NULL, 10, 4, 6, 5, 1, 12, true, 'forward', 2, 1.5, now()),"
                " (9, 'wiki', 'api', 'failed', 'RuntimeError: boom', 3, 0, 3, 0, 3, 0, true, 'backward', 0, NULL,"
                " now())"
            )
        finally:
            await connection.close()
        yield dsn


async def test_sync_runs_move_to_runs_with_their_ids(old_dsn: str) -> None:
    assert "0021_runs.sql" in await apply_migrations(old_dsn)

    connection = await asyncpg.connect(old_dsn)
    try:
        assert await connection.fetchval("SELECT to_regclass('sync_runs')") is None
        rows = await connection.fetch("SELECT * FROM runs ORDER BY id")
    finally:
        await connection.close()
    assert [(row["id"], row["kind"], row["trigger"], row["status"], row["error"]) for row in rows] == [
        (7, "sync", "schedule", "succeeded", None),
        (9, "sync", "api", "failed", "RuntimeError: boom"),
    ]
    ready = json.loads(rows[0]["progress"])
    assert ready == {
        "listed": 10,
        "unchanged": 4,
        "changed": 6,
        "indexed": 5,
        "deleted": 0,
        "failed": 1,
        "chunks": 12,
        "skipped": 2,
        "listing_done": True,
        "direction": "forward",
        "resumed": False,
        "total": 10,
        "done": 10,
        "rate": 1.5,
        "eta_seconds": None,
    }


async def test_new_runs_number_after_the_moved_ones(old_dsn: str) -> None:
    await apply_migrations(old_dsn)
    pool = await asyncpg.create_pool(old_dsn, min_size=1, max_size=2)
    assert pool is not None
    store = RunStore(pool, old_dsn)
    try:
        run = await store.start("wiki", "api")
        assert run.id == 10
        assert [old.id for old in await store.runs("wiki")] == [10, 9, 7]
    finally:
        await store.aclose()
        await pool.close()
