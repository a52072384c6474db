"""Owner liveness of sync runs on a real PostgreSQL: a run whose process is SIGKILLed, or whose
database session drops, is failed at once as ownerless (no stale timeout), while a live owner's run
still refuses a second start."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.api.syncs import sync_router
from ragstream.control.scheduler import Scheduler
from ragstream.storage.database import connect_pool
from ragstream.storage.runs import OWNER_GONE, RunInProgress, RunStatus, RunStore
from tests.support.connections import private_database
from tests.support.run_owner import owner_locks
from tests.support.runs import sync_runner

# Its "wiki" connection is a folder made with an API-style id, so it must lie in a root.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("folder_roots")]

# Hours: any run failed in these tests was failed for its owner, never by the clock.
_STALE_S = 4 * 3600


@pytest.fixture
async def fresh_dsn(database_url: str) -> AsyncIterator[str]:
    """Reaping acts on every run of a database: these tests must not meet the others' runs."""
    async with private_database(database_url) as dsn:
        yield dsn


@pytest.fixture
async def pool(fresh_dsn: str, tmp_path: Path) -> AsyncIterator[asyncpg.Pool]:
    opened = await connect_pool(fresh_dsn)
    try:
        await opened.execute(
            "INSERT INTO connections (id, platform, name, config) VALUES ('wiki', 'folder', 'wiki', $1)",
            json.dumps({"path": str(tmp_path)}),
        )
        yield opened
    finally:
        await opened.close()


@pytest.fixture
async def other(pool: asyncpg.Pool, fresh_dsn: str) -> AsyncIterator[RunStore]:
    """Another replica's store: it never owned the runs it judges."""
    store = RunStore(pool, fresh_dsn, stale_timeout_s=_STALE_S)
    try:
        yield store
    finally:
        await store.aclose()


async def _until_reaped(store: RunStore, run_id: int) -> float:
    """Seconds until ``store`` fails the run as ownerless; PostgreSQL ends a killed client's session
    as soon as it reads the closed socket, which takes milliseconds, not the stale timeout."""
    started = time.monotonic()
    while time.monotonic() - started < 10:
        if [run.id for run in await store.reap("wiki")] == [run_id]:
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run_id} was not failed as ownerless within 10 s")


async def test_a_sigkilled_owner_is_seen_at_once_and_a_new_run_starts(
    fresh_dsn: str, pool: asyncpg.Pool, other: RunStore
) -> None:
    # The test runs from the repository root, where ``tests`` is importable.
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.run_owner", fresh_dsn, "wiki", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert owner.stdout is not None
        run_id = int(await asyncio.wait_for(owner.stdout.readline(), 60))
        # Alive: the other replica leaves its run alone and refuses a second one.
        assert await other.reap() == []
        with pytest.raises(RunInProgress) as refused:
            await other.start("wiki", "api")
        assert refused.value.run is not None and refused.value.run.id == run_id

        owner.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(owner.wait(), 10) == -signal.SIGKILL
        assert await _until_reaped(other, run_id) < 5
    finally:
        if owner.returncode is None:
            owner.kill()
            await owner.wait()

    failed = await other.get(run_id)
    assert failed is not None and (failed.status, failed.error) == (RunStatus.FAILED, OWNER_GONE)
    assert await pool.fetchval("SELECT sync_error FROM connections WHERE id = 'wiki'") == OWNER_GONE
    replacement = await other.start("wiki", "api")
    assert replacement.status is RunStatus.QUEUED and replacement.id != run_id


class HungPipeline:
    """A sync that never progresses: only its owner's liveness can tell it from a slow one."""

    async def sync(self, connector: object, on_progress: object = None) -> None:
        await asyncio.Event().wait()


async def _owner_backend(pool: asyncpg.Pool) -> int:
    pid = await pool.fetchval(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    assert isinstance(pid, int)
    return pid


async def test_a_dropped_owner_session_fails_the_run_and_its_runner_stops(
    fresh_dsn: str, pool: asyncpg.Pool, other: RunStore
) -> None:
    """The process is alive but has lost its lock: the run is failed for everyone, and the runner,
    whose next progress write finds the run no longer syncing, stops instead of syncing unseen."""
    mine = RunStore(pool, fresh_dsn, stale_timeout_s=_STALE_S)
    runner = sync_runner(mine, HungPipeline, progress_interval_s=0.05)  # type: ignore[arg-type]
    try:
        run = await mine.start("wiki", "api")
        claimed = await mine.claim(2, ["sync"])
        assert claimed is not None and claimed.id == run.id
        task = asyncio.create_task(runner.execute(claimed))
        await asyncio.sleep(0.2)
        assert await other.reap() == [] and not task.done()

        await pool.execute("SELECT pg_terminate_backend($1)", await _owner_backend(pool))
        await _until_reaped(other, run.id)
        outcome = await asyncio.wait_for(task, 10)
        assert (outcome.run, outcome.result) == (None, None)
        failed = await other.get(run.id)
        assert failed is not None and (failed.status, failed.error) == (RunStatus.FAILED, OWNER_GONE)

        # The same process owns its next run through a new session.
        again = await mine.start("wiki", "cli", running=True)
        assert await other.reap() == []
        assert await mine.finish(again.id, RunStatus.SUCCEEDED, None, again.progress) is not None
        assert await owner_locks(pool) == 0
    finally:
        await mine.aclose()


async def test_status_and_scheduler_fail_an_ownerless_run(fresh_dsn: str, pool: asyncpg.Pool, other: RunStore) -> None:
    """Closing a store is the quiet form of dying: whoever looks next (the status API, ``ragstream
    status``'s overview, the scheduler) fails the run it left behind."""

    async def ready() -> bool:
        return True

    for look in ("api", "overview", "scheduler"):
        mine = RunStore(pool, fresh_dsn, stale_timeout_s=_STALE_S)
        run = await mine.start("wiki", "cli", running=True)
        await mine.aclose()
        if look == "api":
            app = create_app(lambda: None, ready=ready, routers=[sync_router(lambda: other)])  # type: ignore[arg-type,return-value]
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                status = (await client.get("/v1/connections/wiki/status")).json()
            assert (status["status"], status["reason"]) == ("Failed", OWNER_GONE)
        elif look == "overview":
            [line] = await other.overview()
            assert line.latest is not None and (line.latest.status, line.latest.error) == (
                RunStatus.FAILED,
                OWNER_GONE,
            )
            assert line.sync_error == OWNER_GONE
        else:
            scheduler = Scheduler(fresh_dsn, other)
            try:
                await scheduler.step()
            finally:
                await scheduler.stop()
        failed = await other.get(run.id)
        assert failed is not None and (failed.status, failed.error) == (RunStatus.FAILED, OWNER_GONE), look


async def test_an_idle_session_timeout_does_not_end_a_healthy_owner(
    fresh_dsn: str, pool: asyncpg.Pool, other: RunStore
) -> None:
    """The owner session is idle for the whole sync: a server's idle_session_timeout must not end it
    and fail the run as ownerless."""
    await pool.execute(
        f"ALTER DATABASE {await pool.fetchval('SELECT current_database()')} SET idle_session_timeout = 200"
    )
    mine = RunStore(pool, fresh_dsn, stale_timeout_s=_STALE_S)
    try:
        run = await mine.start("wiki", "cli", running=True)
        await asyncio.sleep(1.0)
        assert await other.reap() == []
        assert await mine.finish(run.id, RunStatus.SUCCEEDED, None, run.progress) is not None
    finally:
        await mine.aclose()
