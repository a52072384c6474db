"""Sync runs on a real PostgreSQL: one active run per connection, stale runs, the concurrency limit,
the scheduler's leader election, progress of a real folder sync, failures and the embedding guard."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.api.syncs import sync_counts, sync_router
from ragstream.connectors.registry import register_folder
from ragstream.control.scheduler import SCHEDULER_LOCK, Scheduler
from ragstream.embedding.base import Embedder, EmbeddingError, TextKind, Vectors
from ragstream.failures import StageRetry
from ragstream.pipeline import EmbeddedPipeline
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import Runtime
from ragstream.stages.embed import EmbedService
from ragstream.storage.database import connect_pool
from ragstream.storage.runs import Heartbeat, RagDisabled, RunInProgress, RunStatus, RunStore
from tests.support.connections import private_database
from tests.support.run_owner import owner_locks
from tests.support.runs import sync_runner

pytestmark = pytest.mark.integration


@pytest.fixture
async def fresh_dsn(database_url: str) -> AsyncIterator[str]:
    """A database of its own on the test server: claims and the scheduler see every connection of a
    database, so these tests must not share one with the others."""
    async with private_database(database_url) as dsn:
        yield dsn


@pytest.fixture
async def pool(fresh_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    opened = await connect_pool(fresh_dsn)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture
async def runs(pool: asyncpg.Pool, fresh_dsn: str) -> AsyncIterator[RunStore]:
    store = RunStore(pool, fresh_dsn)
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
async def shared(runtime: Runtime) -> AsyncIterator[Runtime]:
    """The session's runtime; the connections a test adds are deleted after it with their documents,
    so the corpus statistics of BM25 that other tests rank by stay as they were."""
    before = [row["id"] for row in await runtime.pool.fetch("SELECT id FROM connections")]
    yield runtime
    await runtime.pool.execute("DELETE FROM connections WHERE NOT (id = ANY($1::text[]))", before)


@pytest.fixture
async def shared_runs(shared: Runtime) -> AsyncIterator[RunStore]:
    """A store over the session's runtime, closed even when its test fails: an owner session left
    open would keep its runs' locks for the rest of the test session."""
    store = RunStore(shared.pool, shared.dsn)
    try:
        yield store
    finally:
        await store.aclose()


async def add_connection(pool: asyncpg.Pool, connection_id: str, platform: str = "folder", **columns: object) -> None:
    await pool.execute("INSERT INTO connections (id, platform, name) VALUES ($1, $2, $1)", connection_id, platform)
    for column, value in columns.items():
        await pool.execute(f"UPDATE connections SET {column} = $2 WHERE id = $1", connection_id, value)


async def test_a_second_start_while_one_is_active_is_refused(pool: asyncpg.Pool, runs: RunStore) -> None:
    await add_connection(pool, "wiki")
    first = await runs.start("wiki", "api")
    with pytest.raises(RunInProgress) as queued:
        await runs.start("wiki", "schedule")
    assert queued.value.run is not None and queued.value.run.id == first.id

    claimed = await runs.claim(2, ["sync"])
    assert claimed is not None and claimed.status is RunStatus.RUNNING
    with pytest.raises(RunInProgress, match="Sync already in progress"):
        await runs.start("wiki", "api")

    done = await runs.finish(first.id, RunStatus.SUCCEEDED, None, {"listed": 3, "indexed": 3, "rate": 1.5})
    assert done is not None and done.status is RunStatus.SUCCEEDED
    assert (await runs.start("wiki", "api")).status is RunStatus.QUEUED


async def test_a_connection_with_rag_off_is_not_synced(pool: asyncpg.Pool, runs: RunStore) -> None:
    await add_connection(pool, "direct-only", rag_enabled=False)
    with pytest.raises(RagDisabled, match="RAG is off"):
        await runs.start("direct-only", "api")
    with pytest.raises(RagDisabled):
        await runs.start("no-such-connection", "api")
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE connection_id = 'direct-only'") == 0


async def test_a_silent_run_goes_stale_and_a_new_start_replaces_it(pool: asyncpg.Pool, runs: RunStore) -> None:
    await add_connection(pool, "wiki")
    old = await runs.start("wiki", "api")
    assert await runs.claim(2, ["sync"]) is not None
    await pool.execute(
        "UPDATE runs SET started_at = now() - interval '3 hours', heartbeat_at = now() - interval '2 hours'"
        " WHERE id = $1",
        old.id,
    )

    new = await runs.start("wiki", "api")

    failed = await runs.get(old.id)
    assert failed is not None and failed.status is RunStatus.FAILED and failed.error is not None
    assert failed.error.startswith("stale: no progress for ") and failed.error.endswith(" s")
    assert int(failed.error.split()[-2]) >= 7200
    assert new.status is RunStatus.QUEUED and new.id != old.id
    assert await pool.fetchval("SELECT sync_error FROM connections WHERE id = 'wiki'") == failed.error
    # The stale run's process finishing late does not revive it.
    assert await runs.finish(old.id, RunStatus.SUCCEEDED, None, {}) is None


async def test_runs_over_the_concurrency_limit_stay_queued(pool: asyncpg.Pool, runs: RunStore) -> None:
    for name in ("a", "b", "c"):
        await add_connection(pool, name)
        await runs.start(name, "schedule")

    claimed = [await runs.claim(2, ["sync"]), await runs.claim(2, ["sync"]), await runs.claim(2, ["sync"])]

    assert [run.connection_id if run else None for run in claimed] == ["a", "b", None]
    waiting = await runs.latest("c")
    assert waiting is not None and waiting.status is RunStatus.QUEUED
    first = claimed[0]
    assert first is not None
    await runs.finish(first.id, RunStatus.FAILED, "RuntimeError: boom", {})
    third = await runs.claim(2, ["sync"])
    assert third is not None and third.connection_id == "c"
    assert await pool.fetchval("SELECT sync_error FROM connections WHERE id = 'a'") == "RuntimeError: boom"


async def test_one_scheduler_leads_and_another_takes_over_when_its_connection_drops(
    fresh_dsn: str, pool: asyncpg.Pool
) -> None:
    await add_connection(pool, "due")
    await add_connection(pool, "off", rag_enabled=False)
    await add_connection(pool, "disabled", status="disabled")
    await add_connection(pool, "manual", schedule_seconds=0)
    other_pool = await connect_pool(fresh_dsn)
    stores = [RunStore(pool, fresh_dsn), RunStore(other_pool, fresh_dsn)]
    leader, follower = (Scheduler(fresh_dsn, store) for store in stores)
    try:
        enqueued = await leader.step()
        assert [run.connection_id for run in enqueued] == ["due"]
        assert enqueued[0].trigger == "schedule"
        await add_connection(pool, "later")
        assert await follower.step() == []
        assert (leader.is_leader, follower.is_leader) == (True, False)
        assert [run.connection_id for run in await leader.step()] == ["later"]

        # Only this database's leader: other tests' databases on the server have one too.
        await pool.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND objid = $1",
            SCHEDULER_LOCK,
        )
        await add_connection(pool, "after")
        assert [run.connection_id for run in await follower.step()] == ["after"]
        assert follower.is_leader
        assert await leader.step() == []
        assert not leader.is_leader

        await follower.stop()
        await leader.step()
        assert leader.is_leader
    finally:
        await leader.stop()
        await follower.stop()
        for store in stores:
            await store.aclose()
        await other_pool.close()
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE connection_id IN ('off', 'disabled', 'manual')") == 0


class RecordingRunStore(RunStore):
    """Keeps every progress write, to show the row moves while the sync runs."""

    def __init__(self, pool: asyncpg.Pool, dsn: str) -> None:
        super().__init__(pool, dsn)
        self.writes: list[dict[str, Any]] = []
        self.statuses: list[str] = []
        self._wrote = asyncio.Event()

    async def written(self, count: int) -> None:
        """Return once ``count`` progress writes have happened."""
        while len(self.writes) < count:
            self._wrote.clear()
            await self._wrote.wait()

    async def progress(self, run_id: int, document: Mapping[str, Any], *, moved: bool) -> Heartbeat:
        written = await super().progress(run_id, document, moved=moved)
        self.statuses.append(await self._pool.fetchval("SELECT status FROM runs WHERE id = $1", run_id))
        self.writes.append(dict(document))
        self._wrote.set()
        return written


@pytest.fixture
async def recording_runs(shared: Runtime) -> AsyncIterator[RecordingRunStore]:
    store = RecordingRunStore(shared.pool, shared.dsn)
    try:
        yield store
    finally:
        await store.aclose()


async def test_a_folder_sync_writes_progress_then_ends_ready(
    shared: Runtime, corpus: Path, recording_runs: RecordingRunStore
) -> None:
    for index in range(300):
        (corpus / f"note-{index:03}.md").write_text(f"# Note {index}\n\nSmall note number {index} about ferns.\n")
    runs = recording_runs
    connection_id = await register_folder(shared.store, corpus)
    run = await runs.start(connection_id, "cli", running=True)
    assert run.status is RunStatus.RUNNING

    outcome = await sync_runner(runs, shared.pipeline, progress_interval_s=0.2).execute(run)

    assert outcome.result is not None and outcome.result.ok
    done = await runs.get(run.id)
    assert done is not None and done.status is RunStatus.SUCCEEDED and done.error is None
    assert {name: done.progress[name] for name in sync_counts({})} == {
        "listed": 300,
        "unchanged": 0,
        "changed": 300,
        "indexed": 300,
        "deleted": 0,
        "failed": 0,
        "chunks": 300,
        "skipped": 0,
        "listing_done": True,
        "direction": "backward",
        "resumed": False,
    }
    assert (done.progress["total"], done.progress["done"], done.progress["eta_seconds"]) == (300, 300, None)
    assert done.progress["rate"] > 0 and done.finished_at is not None
    assert runs.writes and any(0 < counts["indexed"] < 300 for counts in runs.writes)
    assert set(runs.statuses) == {"running"}
    assert await shared.pool.fetchval("SELECT sync_error FROM connections WHERE id = $1", connection_id) is None


class UnwritableProgressStore(RunStore):
    """Every progress write fails as on a dropped pool connection; starting and finishing work."""

    def __init__(self, pool: asyncpg.Pool, dsn: str) -> None:
        super().__init__(pool, dsn)
        self.attempts = 0

    async def progress(self, run_id: int, document: Mapping[str, Any], *, moved: bool) -> Heartbeat:
        self.attempts += 1
        raise asyncpg.InterfaceError("connection is closed")


async def test_lost_progress_writes_do_not_fail_the_sync(shared: Runtime, corpus: Path) -> None:
    for index in range(60):
        (corpus / f"note-{index:02}.md").write_text(f"# Note {index}\n\nA note number {index} about mosses.\n")
    runs = UnwritableProgressStore(shared.pool, shared.dsn)
    try:
        connection_id = await register_folder(shared.store, corpus)
        run = await runs.start(connection_id, "cli", running=True)
        outcome = await sync_runner(runs, shared.pipeline, progress_interval_s=0.005).execute(run)
        assert runs.attempts > 0
        assert outcome.run is not None and (outcome.run.status, outcome.run.progress["indexed"]) == (
            RunStatus.SUCCEEDED,
            60,
        )
    finally:
        await runs.aclose()


class HungPipeline:
    """A sync that never progresses, like a platform call that never answers."""

    async def sync(self, connector: object, on_progress: object = None) -> None:
        await asyncio.Event().wait()


async def test_a_hung_sync_goes_stale_and_stops_or_fails_when_cancelled(
    shared: Runtime, corpus: Path, recording_runs: RecordingRunStore
) -> None:
    runs = recording_runs
    connection_id = await register_folder(shared.store, corpus)
    runner = sync_runner(runs, HungPipeline, progress_interval_s=0.01)  # type: ignore[arg-type]
    hung = await runs.start(connection_id, "api", running=True)
    task = asyncio.create_task(runner.execute(hung))
    await runs.written(3)
    row = await runs.get(hung.id)
    assert row is not None and row.status is RunStatus.RUNNING
    assert row.heartbeat_at == row.started_at  # progress rows written, but nothing moved

    await shared.pool.execute("UPDATE runs SET heartbeat_at = now() - interval '1 hour' WHERE id = $1", hung.id)
    replacement = await runs.start(connection_id, "api", running=True)
    outcome = await task  # the hung sync noticed that its run was failed as stale, and stopped
    assert outcome.run is None and outcome.result is None
    stale = await runs.get(hung.id)
    assert stale is not None and stale.status is RunStatus.FAILED and (stale.error or "").startswith("stale: ")
    assert await owner_locks(shared.pool, hung.id) == 0  # released, not kept until the process ends
    assert await owner_locks(shared.pool, replacement.id) == 1

    task = asyncio.create_task(runner.execute(replacement))
    await runs.written(len(runs.writes) + 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    cancelled = await runs.get(replacement.id)
    assert cancelled is not None
    assert (cancelled.status, cancelled.error) == (RunStatus.FAILED, "cancelled: the process stopped")


async def test_a_failing_connector_fails_the_run_with_its_reason(
    shared: Runtime, tmp_path: Path, shared_runs: RunStore
) -> None:
    runs = shared_runs
    runner = sync_runner(runs, shared.pipeline)
    platform_id = f"web-{uuid.uuid4().hex[:8]}"
    await shared.store.ensure_connection(platform_id, "web", "Team site")
    feishu_id = f"feishu-{uuid.uuid4().hex[:8]}"
    await shared.store.ensure_connection(feishu_id, "feishu", "Team wiki")
    gone = tmp_path / "gone"
    gone.mkdir()
    folder_id = await register_folder(shared.store, gone)
    gone.rmdir()

    for connection_id, reason in [
        (platform_id, "no connector for platform web in this build"),
        (feishu_id, f"feishu connection {feishu_id} needs credentials app_id, app_secret"),
        (folder_id, f"NotADirectoryError: {gone} is not a folder"),
    ]:
        run = await runs.start(connection_id, "api", running=True)
        outcome = await runner.execute(run)
        assert outcome.result is None and outcome.run is not None
        assert (outcome.run.status, outcome.run.error) == (RunStatus.FAILED, reason)
        assert await runs.active(connection_id) is None
        assert await shared.pool.fetchval("SELECT sync_error FROM connections WHERE id = $1", connection_id) == reason


class FlakyEmbedder:
    """The local model, except that texts without "survivor" come back without a vector, as from a
    degraded provider (DashScope answering fewer embeddings than texts)."""

    def __init__(self, inner: Embedder) -> None:
        self._inner = inner

    @property
    def model_key(self) -> str:
        return self._inner.model_key

    @property
    def dimension(self) -> int:
        return self._inner.dimension

    async def warm_up(self) -> None:
        await self._inner.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if not all("survivor" in text for text in texts):
            raise EmbeddingError(f"answer has 0 vectors for {len(texts)} texts", retryable=True, provider="fake")
        return await self._inner.embed(texts, kind)

    async def aclose(self) -> None:
        """The inner embedder belongs to the runtime."""


async def test_a_degraded_embedder_fails_the_sync_and_keeps_the_previous_index(
    shared: Runtime, corpus: Path, shared_runs: RunStore
) -> None:
    for index in range(36):
        (corpus / f"doc-{index:02}.md").write_text(f"# Doc {index}\n\nThe heronwick ledger entry {index} is filed.\n")
    runs = shared_runs
    connection_id = await register_folder(shared.store, corpus)
    first = await sync_runner(runs, shared.pipeline).execute(await runs.start(connection_id, "cli", running=True))
    assert first.run is not None and first.run.status is RunStatus.SUCCEEDED

    async def snapshot() -> tuple[list[tuple[str, str, str]], list[str]]:
        rows = await shared.pool.fetch(
            "SELECT d.source, d.status, c.id FROM documents d LEFT JOIN chunks c ON c.document_id = d.id"
            " WHERE d.connection_id = $1 AND d.source LIKE 'doc-%' ORDER BY 1, 3",
            connection_id,
        )
        response = await shared.retriever.search(
            SearchRequest(query="heronwick ledger entry", filters=SearchFilters(connection_ids=[connection_id]))
        )
        return [(row["source"], row["status"], row["id"]) for row in rows], [r.chunk_id for r in response.results]

    before = await snapshot()
    for index in range(35):
        (corpus / f"doc-{index:02}.md").write_text(f"# Doc {index}\n\nThe heronwick ledger entry {index} is revised.\n")
    (corpus / "doc-35.md").unlink()
    for index in range(4):
        (corpus / f"a-survivor-{index}.md").write_text(f"# Survivor {index}\n\nA survivor note {index}.\n")
    flaky = EmbeddedPipeline(
        shared.store,
        shared.chunker,
        EmbedService(FlakyEmbedder(shared.embedder)),
        shared.indexer,
        max_document_bytes=shared.settings.max_document_bytes,
        retry=StageRetry(backoff_s=0.001, backoff_max_s=0.001),  # the guard counts a chunk once retries ran out
    )
    run = await runs.start(connection_id, "api", running=True)

    outcome = await sync_runner(runs, lambda: flaky).execute(run)

    assert outcome.result is None and outcome.run is not None
    failed = outcome.run
    assert failed.status is RunStatus.FAILED and failed.error is not None
    assert failed.error.startswith("embedding degraded: 8") or failed.error.startswith("embedding degraded: 9")
    assert "% of chunks" in failed.error and "without a vector" in failed.error
    assert failed.progress["failed"] < 35  # stopped early instead of marching through every document
    assert await snapshot() == before  # same chunk ids, doc-35 not deleted, same search results
    assert await shared.pool.fetchval("SELECT sync_error FROM connections WHERE id = $1", connection_id) == (
        failed.error
    )


async def ready() -> bool:
    return True


async def test_the_sync_routes(shared: Runtime, corpus: Path, shared_runs: RunStore) -> None:
    (corpus / "a.md").write_text("# A\n\nText.\n")
    connection_id = await register_folder(shared.store, corpus)
    runs = shared_runs
    woken: list[bool] = []
    app = create_app(
        lambda: shared.retriever, ready=ready, routers=[sync_router(lambda: runs, lambda: woken.append(True))]
    )

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        never = await client.get(f"/v1/connections/{connection_id}/status")
        assert never.status_code == 200 and never.json()["status"] is None
        started = await client.post(f"/v1/connections/{connection_id}/sync")
        assert started.status_code == 202, started.text
        assert (started.json()["status"], started.json()["trigger"]) == ("Queued", "api")
        assert woken == [True]
        again = await client.post(f"/v1/connections/{connection_id}/sync")
        assert (again.status_code, again.json()) == (409, {"detail": "Sync already in progress"})
        unknown = await client.post("/v1/connections/no-such-connection/sync")
        assert unknown.status_code == 404

        await runs.finish(
            started.json()["id"], RunStatus.FAILED, "RuntimeError: boom", {"listed": 1, "failed": 1, "rate": 0.5}
        )
        status = (await client.get(f"/v1/connections/{connection_id}/status")).json()
        assert (status["status"], status["reason"]) == ("Failed", "RuntimeError: boom")
        assert (status["progress"]["listed"], status["progress"]["failed"], status["progress"]["rate"]) == (1, 1, 0.5)
        listed = (await client.get(f"/v1/connections/{connection_id}/syncs")).json()
        assert [run["id"] for run in listed] == [started.json()["id"]]
