"""The one runner with a kind of its own: a job function registered under a kind runs through claim,
progress writes with rate and ETA, and the end of its run; a cancel asked by another store stops it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from ragstream.control.runner import CANCELLED_ON_REQUEST, JobContext, Runner
from ragstream.jobs.progress import RunProgress
from ragstream.logs import current_context
from ragstream.storage.database import connect_pool
from ragstream.storage.runs import RunInProgress, RunStatus, RunStore
from tests.support.connections import private_database


@dataclass(slots=True, kw_only=True)
class PagesProgress(RunProgress):
    """A toy kind's counts: pages to crawl and pages crawled."""

    pages: int = 0
    crawled: int = 0

    @property
    def total(self) -> int:
        return self.pages

    @property
    def done(self) -> int:
        return self.crawled

    @property
    def processed(self) -> int:
        return self.crawled

    def counts(self) -> dict[str, Any]:
        return {"pages": self.pages, "crawled": self.crawled}


class Crawl:
    """A toy job: crawls ``pages`` pages, stopping after ``hold_at`` until ``resume`` is set."""

    def __init__(self, pages: int, hold_at: int) -> None:
        self.pages, self.hold_at = pages, hold_at
        self.held = asyncio.Event()
        self.resume = asyncio.Event()
        self.params: list[dict[str, Any]] = []
        self.log_ids: list[dict[str, str]] = []

    async def __call__(self, context: JobContext) -> str:
        self.params.append(context.run.params)
        self.log_ids.append(dict(current_context()))
        progress = PagesProgress(pages=self.pages)
        for _ in range(self.pages):
            if progress.crawled == self.hold_at:
                self.held.set()
                await self.resume.wait()
            await asyncio.sleep(0.01)
            progress.crawled += 1
            context.publish(progress)
        return "crawled"


@pytest.fixture
async def pool(database_url: str, tmp_path: Path) -> AsyncIterator[tuple[asyncpg.Pool, str]]:
    """A database of its own: the runner claims any queued run of its kinds."""
    async with private_database(database_url) as dsn:
        opened = await connect_pool(dsn)
        try:
            await opened.execute(
                "INSERT INTO connections (id, platform, name, config) VALUES ('wiki', 'folder', 'wiki', $1)",
                json.dumps({"path": str(tmp_path)}),
            )
            yield opened, dsn
        finally:
            await opened.close()


async def written(store: RunStore, run_id: int, crawled: int) -> dict[str, Any]:
    for _ in range(600):  # a deadline for a loaded machine, not a speed requirement
        run = await store.get(run_id)
        assert run is not None
        if run.progress.get("crawled") == crawled:
            return run.progress
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run_id} never wrote crawled = {crawled}")


async def test_a_registered_kind_runs_with_progress_rate_and_eta(pool: tuple[asyncpg.Pool, str]) -> None:
    connections, dsn = pool
    store = RunStore(connections, dsn)
    crawl = Crawl(pages=10, hold_at=4)
    # One function and one registry entry: the table takes any kind a runner registers.
    runner = Runner(store, {"crawl": crawl}, progress_interval_s=0.05)
    succeeded = {"kind": "crawl", "status": "succeeded"}
    finished_before = REGISTRY.get_sample_value("ragstream_runs_finished_total", succeeded) or 0
    try:
        queued = await store.start("wiki", "api", kind="crawl", params={"seed": "https://example.org"})
        assert queued.status is RunStatus.QUEUED
        [task] = await runner.claim_pending()
        await crawl.held.wait()
        midway = await written(store, queued.id, 4)
        assert (midway["pages"], midway["total"], midway["done"]) == (10, 10, 4)
        assert midway["rate"] > 0 and midway["eta_seconds"] is not None and midway["eta_seconds"] > 0
        running = await store.get(queued.id)
        assert running is not None and running.status is RunStatus.RUNNING and running.owner == store.owner_name
        crawl.resume.set()
        outcome = await task
    finally:
        await store.aclose()
    assert outcome.result == "crawled" and crawl.params == [{"seed": "https://example.org"}]
    # The job's log records carry its run and connection; the run's end is counted by kind and status.
    assert crawl.log_ids == [{"connection_id": "wiki", "run_id": str(queued.id)}]
    assert REGISTRY.get_sample_value("ragstream_runs_finished_total", succeeded) == finished_before + 1
    assert outcome.run is not None and outcome.run.status is RunStatus.SUCCEEDED
    assert (outcome.run.progress["done"], outcome.run.progress["eta_seconds"]) == (10, None)
    assert outcome.run.finished_at is not None and outcome.run.error is None


async def test_a_cancel_asked_elsewhere_stops_the_job_and_ends_the_run_cancelled(
    pool: tuple[asyncpg.Pool, str],
) -> None:
    connections, dsn = pool
    owner, elsewhere = RunStore(connections, dsn), RunStore(connections, dsn)
    crawl = Crawl(pages=10, hold_at=3)
    runner = Runner(owner, {"crawl": crawl}, progress_interval_s=0.05)
    try:
        run = await elsewhere.start(None, "api", kind="crawl")
        [task] = await runner.claim_pending()
        await crawl.held.wait()
        asked = await elsewhere.request_cancel(run.id)
        assert asked is not None and asked.cancel_requested and asked.status is RunStatus.RUNNING
        outcome = await task  # the job never resumes: only the cancel ends it
        queued = await elsewhere.start(None, "api", kind="crawl")
        dropped = await elsewhere.request_cancel(queued.id)  # never claimed: cancelled at once
    finally:
        await owner.aclose()
        await elsewhere.aclose()
    assert outcome.run is not None and (outcome.run.status, outcome.run.error) == (
        RunStatus.CANCELLED,
        CANCELLED_ON_REQUEST,
    )
    assert outcome.run.progress["crawled"] == 3 and outcome.result is None
    assert dropped is not None and dropped.status is RunStatus.CANCELLED and dropped.finished_at is not None


async def test_a_deployment_wide_reindex_and_a_connections_exclude_each_other(pool: tuple[asyncpg.Pool, str]) -> None:
    """Both move the connection's vectors: whichever is queued first wins, the other is a 409 at its
    start, even when two replicas start them at the same moment."""
    connections, dsn = pool
    await connections.execute(
        "INSERT INTO connections (id, platform, name, config) VALUES ('notes', 'folder', 'notes', '{}')"
    )
    first, second = RunStore(connections, dsn), RunStore(connections, dsn)
    try:
        deployment = await first.start(None, "api", kind="reindex")
        with pytest.raises(RunInProgress) as refused:
            await second.start("wiki", "api", kind="reindex")
        assert refused.value.run is not None and refused.value.run.id == deployment.id
        await first.request_cancel(deployment.id)
        connection = await second.start("wiki", "api", kind="reindex")
        with pytest.raises(RunInProgress):
            await first.start(None, "api", kind="reindex")
        assert (await first.start("notes", "api", kind="reindex")).connection_id == "notes"  # another connection
        for run in await first.active_of_kind("reindex"):
            await first.request_cancel(run.id)
        deployment_start, connection_start = (
            first.start(None, "api", kind="reindex"),
            second.start("wiki", "api", kind="reindex"),
        )
        raced = await asyncio.gather(deployment_start, connection_start, return_exceptions=True)
    finally:
        await first.aclose()
        await second.aclose()
    assert connection.connection_id == "wiki"
    assert sorted(type(outcome).__name__ for outcome in raced) == ["Run", "RunInProgress"]
