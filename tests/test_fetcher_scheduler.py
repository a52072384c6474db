"""The connector-fetcher service runs the scheduler in Kafka mode: a connection due for a sync is
queued by the leader and claimed and announced by the fetcher, in process, on real PostgreSQL and Kafka."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ragstream.connectors.registry import register_folder
from ragstream.storage.documents import DocumentStore
from ragstream_fetcher.main import create_app
from tests.support.connections import fetcher_database
from tests.support.run_owner import owner_locks

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


async def test_the_fetcher_queues_and_runs_a_due_connection(
    database_url: str, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    (folder / "a.md").write_text("# A\n\nA page the scheduler finds on its own.\n")
    # A database of its own: the scheduler acts on every due connection of its database.
    async with fetcher_database(
        database_url, kafka_bootstrap, monkeypatch, scheduler_interval_s="0.2", fetcher_interval_s="0"
    ) as pool:
        connection_id = await register_folder(DocumentStore(pool), folder)  # never synced: due at once
        app = create_app()
        async with app.router.lifespan_context(app):
            deadline = time.monotonic() + 60
            while (
                run := await pool.fetchrow(
                    "SELECT trigger, status, (progress->>'listed')::int AS listed,"
                    " (progress->>'changed')::int AS changed,"
                    " coalesce((progress->>'listing_done')::boolean, false) AS listing_done FROM runs"
                    " WHERE kind = 'sync' AND connection_id = $1",
                    connection_id,
                )
            ) is None or not run["listing_done"]:
                assert time.monotonic() < deadline, f"no scheduled run announced the folder: {run}"
                await asyncio.sleep(0.1)
            # Announced; no indexer runs here, so the run waits for the commit, syncing.
            assert dict(run) == {
                "trigger": "schedule",
                "status": "running",
                "listed": 1,
                "changed": 1,
                "listing_done": True,
            }
        stopped = await pool.fetchrow("SELECT status, error FROM runs WHERE connection_id = $1", connection_id)
        assert dict(stopped) == {"status": "failed", "error": "cancelled: the process stopped"}


async def test_a_claimed_run_that_cannot_start_fails_and_frees_its_connection(
    database_url: str, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    async with fetcher_database(
        database_url, kafka_bootstrap, monkeypatch, scheduler_interval_s="0.2", fetcher_interval_s="0"
    ) as pool:
        connection_id = await register_folder(DocumentStore(pool), folder)
        folder.rmdir()  # the connector cannot be built: NotADirectoryError
        app = create_app()
        async with app.router.lifespan_context(app):
            deadline = time.monotonic() + 60
            while (
                run := await pool.fetchrow("SELECT id, status, error FROM runs WHERE connection_id = $1", connection_id)
            ) is None or run["status"] != "failed":
                assert time.monotonic() < deadline, f"the run was not failed: {run}"
                await asyncio.sleep(0.1)
            assert run["error"].startswith("NotADirectoryError:")
            # Its owner lock is released while the fetcher lives on: the next start is not refused.
            assert await owner_locks(pool, run["id"]) == 0
