"""Migrations 0021 and 0022 upgrade a database in place: the rows of the old run tables become runs."""

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
            await connection.execute(
                "INSERT INTO reindex_runs (connection_id, source_key, target_key, status, error, chunks_total,"
                " chunks_embedded, rate, started_at) VALUES"
                " (NULL, 'model-a', 'model-b', 'switched', NULL, 40, 40, 8.0, now() - interval '2 days'),"
                " ('wiki', 'model-a', 'model-c', 'running', NULL, 10, 4, 2.0, now() - interval '1 day')"
            )
            await connection.execute(
                "INSERT INTO rechunk_runs (connection_id, index_version, chunking, status, error, documents_total,"
                " documents_done, documents_failed, chunks, started_at) VALUES"
                " ('wiki', 3, '{\"kind\": \"token\"}', 'failed', 'RechunkFailed: 1 of 5', 5, 4, 1, 9, now())"
            )
        finally:
            await connection.close()
        yield dsn


async def test_sync_runs_move_to_runs_with_their_ids(old_dsn: str) -> None:
    assert "0021_runs.sql" in await apply_migrations(old_dsn)

    connection = await asyncpg.connect(old_dsn)
    try:
        assert await connection.fetchval("SELECT to_regclass('sync_runs')") is None
        rows = await connection.fetch("SELECT * FROM runs WHERE kind = 'sync' ORDER BY id")
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


async def test_reindex_and_rechunk_runs_move_to_runs_in_one_vocabulary(old_dsn: str) -> None:
    assert (await apply_migrations(old_dsn))[-1] >= "0022_reindex_rechunk_runs.sql"

    pool = await asyncpg.create_pool(old_dsn, min_size=1, max_size=2)
    assert pool is not None
    store = RunStore(pool, old_dsn)
    try:
        assert await pool.fetchval("SELECT to_regclass('reindex_runs') IS NULL AND to_regclass('rechunk_runs') IS NULL")
        deployment = await store.latest(None, kind="reindex")
        interrupted = await store.latest("wiki", kind="reindex")
        rechunk = await store.latest("wiki", kind="rechunk")
        # A new re-chunk of the connection resumes from the index versions the moved rows name.
        queued = await store.start("wiki", "api", kind="rechunk", params={"chunking": {"kind": "markdown"}})
    finally:
        await store.aclose()
        await pool.close()
    assert deployment is not None and interrupted is not None and rechunk is not None
    assert (deployment.status, deployment.params, deployment.progress["done"]) == (
        "succeeded",
        {"source_key": "model-a", "target_key": "model-b"},
        40,
    )
    assert (interrupted.status, interrupted.params["target_key"]) == ("cancelled", "model-c")
    assert (interrupted.progress["chunks_total"], interrupted.progress["chunks_embedded"]) == (10, 4)
    assert interrupted.finished_at is not None and deployment.id < interrupted.id < rechunk.id
    assert (rechunk.status, rechunk.error, rechunk.params) == (
        "failed",
        "RechunkFailed: 1 of 5",
        {"index_version": 3, "chunking": {"kind": "token"}},
    )
    assert (rechunk.progress["documents_done"], rechunk.progress["documents_failed"], rechunk.progress["chunks"]) == (
        4,
        1,
        9,
    )
    assert queued.id > rechunk.id and queued.status == "queued"


async def test_new_runs_number_after_the_moved_ones(old_dsn: str) -> None:
    await apply_migrations(old_dsn)
    pool = await asyncpg.create_pool(old_dsn, min_size=1, max_size=2)
    assert pool is not None
    store = RunStore(pool, old_dsn)
    try:
        run = await store.start("wiki", "api")
        assert run.id > 9  # after the sync runs, and the re-index and re-chunk runs numbered after them
        assert [old.id for old in await store.runs("wiki")] == [run.id, 9, 7]
    finally:
        await store.aclose()
        await pool.close()
