"""Re-index to another embedding model against a real PostgreSQL: search goes on, one model per search."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest

from ragstream.api.http import create_app
from ragstream.api.reindex import reindex_router, spec_model_key
from ragstream.api.runs import runs_router
from ragstream.connectors.folder import FolderConnector
from ragstream.control.kinds import reindex_kind
from ragstream.control.runner import CANCELLED_ON_REQUEST, Job, Runner, RunOutcome
from ragstream.embedding.spaces import ActiveSpace
from ragstream.jobs.progress import RunProgress
from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentHeader, pack_vectors
from ragstream.reindex import Reindexer
from ragstream.retrieval import HybridRetriever, SearchRequest, SearchResponse
from ragstream.runtime import Runtime
from ragstream.stages.embed import embedding_input
from ragstream.stages.index import MixedEmbeddingModelsError
from ragstream.storage.citations import CitationStore
from ragstream.storage.documents import document_id
from ragstream.storage.runs import RunStatus, RunStore
from ragstream.storage.search import SearchStore
from ragstream.storage.spaces import RetiredSpaceError, SpaceStore
from tests.support.embedders import HashEmbedder, dashscope_spec, hash_vector, private_runtime, space_states
from tests.support.runs import in_foreground, reindex_job

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

# The fake vendors listen on 127.0.0.1.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_networks")]
# Registered as a plugin rather than imported, so pytest can rewrite its asserts.
pytest_plugins = ["tests.support.fake_dashscope"]

LOCAL_KEY = "use-multilingual-v3-512"
LOCAL: dict[str, Any] = {"provider": "local"}
QUERIES = ["install the server on linux", "rotate the api keys", "backup and restore the database"]
TOPICS = {
    "install.md": "# Install\n\nDownload the package and run the installer on Linux or macOS.",
    "keys.md": "# Keys\n\nRotate API keys every ninety days; old keys stop working after a grace period.",
    "backup.md": "# Backup\n\nA nightly backup copies the database; restore it with the restore command.",
    "network.md": "# Network\n\nOpen port 8080 for the HTTP API and 9092 for the broker.",
    "logs.md": "# Logs\n\nLogs rotate daily and are kept for two weeks in the logs folder.",
    "users.md": "# Users\n\nInvite users by e-mail; an admin grants them roles and groups.",
}


@pytest.fixture
async def runtime_db(database_url: str, fake_dashscope: FakeDashScope) -> AsyncIterator[Runtime]:
    """A runtime (local model active) on a database of its own: a switch must not reach other tests."""
    async with private_runtime(database_url, fake_dashscope) as runtime:
        yield runtime


async def reindex(
    runtime: Runtime,
    job: Job,
    spec: dict[str, Any],
    *,
    progress_interval_s: float = 2.0,
    observe: Callable[[RunProgress], None] | None = None,
) -> RunOutcome:
    """A deployment-wide re-index run to its end, as ``ragstream reindex`` runs one."""
    return await in_foreground(
        runtime.pool,
        runtime.dsn,
        "reindex",
        None,
        {"spec": spec},
        job,
        progress_interval_s=progress_interval_s,
        observe=observe,
    )


def write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


async def ingest(runtime: Runtime, folder: Path, files: dict[str, str]) -> None:
    write(folder, files)
    report = await runtime.pipeline().sync(FolderConnector(folder))
    assert report.ok, report.failures


async def search(runtime: Runtime, query: str) -> SearchResponse:
    return await runtime.retriever.search(SearchRequest(query=query, top_k=5))


def answer(response: SearchResponse) -> list[tuple[str, int | None]]:
    return [(result.chunk_id, result.vector_rank) for result in response.results]


async def new_document(runtime: Runtime, name: str) -> DocumentHeader:
    connection = f"direct-{uuid.uuid4().hex[:8]}"
    await runtime.store.ensure_connection(connection, "folder", connection)
    return DocumentHeader(
        document_id=document_id(connection, name),
        connection_id=connection,
        external_id=name,
        version=await runtime.store.next_version(),
        content_hash="h",
        title=name,
        source=name,
        media_type="text/markdown",
    )


async def test_searches_during_a_reindex_never_fail_nor_mix_models(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)
    before = {query: answer(await search(runtime, query)) for query in QUERIES}
    # Another process's retriever: it cached the old space and builds the new model from its spec.
    elsewhere_spaces = ActiveSpace(SpaceStore(runtime.pool), runtime.settings.embedding, runtime.embedder, ttl_s=3600)
    elsewhere = HybridRetriever(
        SearchStore(runtime.pool), runtime.embedder, CitationStore(runtime.pool), spaces=elsewhere_spaces
    )
    assert (await elsewhere.search(SearchRequest(query=QUERIES[0], top_k=5))).embedding_space == LOCAL_KEY
    target = runtime.spaces.build(dashscope_spec(fake_dashscope))
    fake_dashscope.delay_s = 0.2  # a re-index that takes a while: searches run all through it
    progress: list[RunProgress] = []
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=2)
    spec = dashscope_spec(fake_dashscope)
    task = asyncio.create_task(reindex(runtime, reindex_job(reindexer, target, spec), spec, observe=progress.append))
    seen: list[tuple[str, str | None, list[tuple[str, int | None]]]] = []

    async def keep_searching(offset: int) -> None:
        """Until a few searches after the switch; several loops at once, so some meet the table drop."""
        after_switch = 0
        while after_switch < len(QUERIES):
            query = QUERIES[(len(seen) + offset) % len(QUERIES)]
            response = await search(runtime, query)  # never raises
            seen.append((query, response.embedding_space, answer(response)))
            after_switch += task.done()

    await asyncio.gather(*(keep_searching(offset) for offset in range(3)))
    run = (await task).run
    assert run is not None and run.status is RunStatus.SUCCEEDED, run
    new_key = target.model_key
    after = {query: answer(await search(runtime, query)) for query in QUERIES}
    assert after != before  # the vector leg's neighbours differ between the models
    for query, space, got in seen:
        assert got == (before if space == LOCAL_KEY else after)[query], space
    assert {space for _, space, _ in seen} == {LOCAL_KEY, new_key}
    assert sum(space == LOCAL_KEY for _, space, _ in seen) > len(QUERIES)  # searched while it built
    assert (await search(runtime, QUERIES[0])).embedding_space == new_key
    # Its cached table is gone: the search goes to the new space whole, query embedded by the new model.
    response = await elsewhere.search(SearchRequest(query=QUERIES[0], top_k=5))
    assert response.embedding_space == new_key and answer(response) == after[QUERIES[0]]
    await elsewhere_spaces.aclose()
    assert await space_states(runtime) == {LOCAL_KEY: ("retired", False), new_key: ("active", True)}
    # The re-indexed vectors are the ones ingest would have produced with the new model.
    row = await runtime.pool.fetchrow(
        "SELECT c.id, d.title, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id LIMIT 1"
    )
    assert row is not None
    table = (await SpaceStore(runtime.pool).active()).table  # type: ignore[union-attr]
    stored = await runtime.pool.fetchval(f"SELECT embedding FROM {table} WHERE chunk_id = $1", row["id"])
    expected = fake_dashscope.expected_vectors([embedding_input(row["title"], row["heading"], row["text"])], 256)[0]
    assert np.allclose(stored.to_numpy(), expected, atol=1e-5)
    assert run.params["source_key"] == LOCAL_KEY and run.params["target_key"] == new_key
    assert run.progress["chunks_embedded"] == run.progress["chunks_total"] == len(TOPICS)
    assert run.progress["done"] == run.progress["total"] == len(TOPICS)
    assert progress[-1].done == len(TOPICS) and len(progress) > 2


async def test_documents_ingested_during_a_reindex_are_searchable_after_the_switch(
    runtime_db: Runtime, tmp_path: Path
) -> None:
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)
    target = HashEmbedder()
    target.pause_on_call = 2  # after the first batch of the backfill
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=2)
    task = asyncio.create_task(reindex(runtime, reindex_job(reindexer, target, LOCAL), LOCAL))
    await target.paused.wait()
    late = {"late.md": "# Zephyr\n\nThe zephyr dashboard shows quarterly widget sales."}
    await ingest(runtime, tmp_path / "late", late)  # committed with the active (local) model
    # An edit replaces a chunk the backfill may have embedded already: its vector goes with it.
    await ingest(runtime, tmp_path / "docs", {"keys.md": "# Keys\n\nKeys of the aardvark vault never expire."})
    assert (await search(runtime, "zephyr widget sales")).embedding_space == LOCAL_KEY
    target.resume.set()
    switched = (await task).run
    assert switched is not None and switched.status is RunStatus.SUCCEEDED
    response = await search(runtime, "zephyr widget sales dashboard")
    assert response.embedding_space == target.model_key
    assert response.results[0].source == "late.md" and response.results[0].vector_rank == 1
    store = SpaceStore(runtime.pool)
    active = await store.active()
    assert active is not None and await store.count_vectors(active.table) == await store.count_chunks()
    assert (await search(runtime, "aardvark vault keys")).results[0].text.endswith("never expire.")
    # Vectors of the old model committing after the switch (embedded just before it) are refused:
    # the document fails, retryably, instead of landing in a table nobody searches.
    chunk = ChunkPayload(ordinal=0, heading="", text="late")
    with pytest.raises(RetiredSpaceError):
        await runtime.store.commit_document(
            await new_document(runtime, "late.md"), [chunk], hash_vector("late", 512)[None, :], LOCAL_KEY
        )
    # Ingest after the switch embeds with the new model.
    await ingest(runtime, tmp_path / "later", {"later.md": "# Quokka\n\nQuokka habitats on Rottnest island."})
    embedded = len(target.texts)
    assert (await search(runtime, "quokka island")).results[0].source == "later.md"
    assert len(target.texts) > embedded and await store.count_vectors(active.table) == await store.count_chunks()


async def test_an_interrupted_reindex_resumes_without_embedding_done_chunks_again(
    runtime_db: Runtime, tmp_path: Path
) -> None:
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)
    first = HashEmbedder()
    first.pause_on_call = 3  # two batches stored, the third held: then cancelled
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=2)
    task = asyncio.create_task(reindex(runtime, reindex_job(reindexer, first, LOCAL), LOCAL, progress_interval_s=0.1))
    await first.paused.wait()
    await asyncio.sleep(0.3)  # the embedder is stuck, yet progress is written
    other = RunStore(runtime.pool, runtime.dsn)  # another replica's: it never owned the run
    running = await other.latest(None, kind="reindex")
    assert running is not None and running.status is RunStatus.RUNNING and running.heartbeat_at is not None
    assert (running.progress["chunks_total"], running.progress["chunks_embedded"]) == (len(TOPICS), 4)
    assert running.progress["rate"] and running.progress["eta_seconds"]
    assert (datetime.now(UTC) - running.heartbeat_at).total_seconds() < 1
    await other.request_cancel(running.id)
    run = (await task).run
    await other.aclose()
    assert run is not None and (run.status, run.error) == (RunStatus.CANCELLED, CANCELLED_ON_REQUEST)
    assert run.progress["chunks_embedded"] == 4
    assert (await search(runtime, QUERIES[0])).embedding_space == LOCAL_KEY
    assert (await space_states(runtime))[first.model_key] == ("building", True)

    second = HashEmbedder()
    result = (await reindex(runtime, reindex_job(reindexer, second, LOCAL), LOCAL)).run
    assert result is not None and result.status is RunStatus.SUCCEEDED
    assert len(second.texts) == len(TOPICS) - 4  # only what the first run had not stored
    assert not set(first.texts[:4]) & set(second.texts)
    assert (await search(runtime, QUERIES[0])).embedding_space == second.model_key


async def test_a_failing_target_leaves_the_old_space_active_and_searchable(runtime_db: Runtime, tmp_path: Path) -> None:
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)
    before = answer(await search(runtime, QUERIES[0]))
    target = HashEmbedder(fail_on_call=2)
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=2)
    run = (await reindex(runtime, reindex_job(reindexer, target, LOCAL), LOCAL)).run
    assert run is not None and run.status is RunStatus.FAILED and run.error is not None and "rejects" in run.error
    assert (await space_states(runtime))[LOCAL_KEY] == ("active", True)
    response = await search(runtime, QUERIES[0])
    assert response.embedding_space == LOCAL_KEY and answer(response) == before


async def test_the_http_api_starts_a_reindex_and_shows_its_progress(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)

    async def ready() -> bool:
        return True

    runs = RunStore(runtime.pool, runtime.dsn)
    runner = Runner(runs, {"reindex": reindex_kind(runtime.reindexer())}, progress_interval_s=0.2)
    router = reindex_router(runs, SpaceStore(runtime.pool), spec_model_key(runtime.spaces), runner.wake)
    app = create_app(lambda: runtime.retriever, ready=ready, routers=[router])
    serving = asyncio.create_task(runner.serve())
    fake_dashscope.delay_s = 0.5  # still running when the second POST comes
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/v1/reindex")).status_code == 404
        incomplete = await client.post("/v1/reindex", json={"provider": "openai", "model": "m"})
        assert incomplete.status_code == 422 and "base_url" in incomplete.text
        assert (await client.get("/v1/reindex")).status_code == 404  # refused before a run was recorded
        started = await client.post("/v1/reindex", json=dashscope_spec(fake_dashscope))
        assert started.status_code == 202, started.text
        assert (
            started.json()["status"] == "queued" and started.json()["target_key"] == "dashscope-text-embedding-v3-256"
        )
        assert (await client.post("/v1/reindex", json=dashscope_spec(fake_dashscope))).status_code == 409
        for _ in range(600):  # a deadline for a loaded machine, not a speed requirement
            body = (await client.get("/v1/reindex")).json()
            if body["status"] not in ("queued", "running"):
                break
            await asyncio.sleep(0.1)
        assert body["status"] == "succeeded" and body["chunks_embedded"] == body["chunks_total"] == len(TOPICS)
        assert body["source_key"] == LOCAL_KEY
        assert body["target_key"] == "dashscope-text-embedding-v3-256"
        again = await client.post("/v1/reindex", json=dashscope_spec(fake_dashscope))
        assert again.status_code == 422 and "already the active" in again.text
        found = await client.post("/v1/search", json={"query": QUERIES[0]})
        assert found.json()["embedding_space"] == "dashscope-text-embedding-v3-256"
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    await runs.aclose()


async def test_the_command_shows_progress_and_switches(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)
    assert runtime.settings.database_url is not None
    env = {
        **os.environ,
        "DATABASE_URL": runtime.settings.database_url,
        "RAGSTREAM_EMBEDDER_API_KEY": fake_dashscope.api_key,
        "COLUMNS": "160",
    }
    args = ["--provider", "dashscope", "--model", "text-embedding-v3", "--dimension", "256"]
    command = [sys.executable, "-m", "ragstream.cli", "reindex", *args, "--base-url", fake_dashscope.base_url]

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    done = await asyncio.to_thread(run)
    assert done.returncode == 0, done.stderr
    assert f"{len(TOPICS)}/{len(TOPICS)}" in done.stderr and "chunks/s" in done.stderr and "ETA" in done.stderr
    assert "dashscope-text-embedding-v3-256" in done.stderr
    # The process that was searching all along now searches the new space.
    assert (await search(runtime, QUERIES[0])).embedding_space == "dashscope-text-embedding-v3-256"
    again = await asyncio.to_thread(run)
    assert again.returncode == 1 and "already the active" in again.stderr


async def test_a_document_whose_batches_came_from_two_models_is_refused_then_replayed(runtime: Runtime) -> None:
    """A switch between two batches of one document: its vectors are not of one space."""
    header = await new_document(runtime, "two.md")
    vectors = [hash_vector(f"part {i}", runtime.embedder.dimension)[None, :] for i in range(2)]

    def batch(index: int, model_key: str) -> ChunksEmbedded:
        chunk = ChunkPayload(ordinal=index, heading="", text=f"part {index}")
        return ChunksEmbedded(
            header=header,
            batch_index=index,
            batch_count=2,
            chunk_count=2,
            chunks=[chunk],
            model_key=model_key,
            dimension=runtime.embedder.dimension,
            vectors=pack_vectors(vectors[index]),
        )

    assert await runtime.indexer.run(batch(0, "retired-model-512")) is None
    with pytest.raises(MixedEmbeddingModelsError):
        await runtime.indexer.run(batch(1, runtime.embedder.model_key))
    # The replay embeds every batch again with the active model: the parked old batch is replaced.
    assert await runtime.indexer.run(batch(0, runtime.embedder.model_key)) is not None


async def test_a_reindex_run_by_one_replica_is_cancelled_through_another(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    """Replica A serves the API and runs nothing; replica B's runner claims the re-index. The cancel
    asked through A reaches B at its next heartbeat: the run ends cancelled, the old space stays."""
    runtime = runtime_db
    await ingest(runtime, tmp_path / "docs", TOPICS)
    before = answer(await search(runtime, QUERIES[0]))

    async def ready() -> bool:
        return True

    runs_a, runs_b = RunStore(runtime.pool, runtime.dsn), RunStore(runtime.pool, runtime.dsn)
    app_a = create_app(
        lambda: runtime.retriever,
        ready=ready,
        routers=[
            reindex_router(runs_a, SpaceStore(runtime.pool), spec_model_key(runtime.spaces), lambda: None),
            runs_router(runs_a),
        ],
    )
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=1)
    runner_b = Runner(runs_b, {"reindex": reindex_kind(reindexer)}, progress_interval_s=0.1, poll_interval_s=0.1)
    fake_dashscope.delay_s = 0.5  # one chunk per call: the run lasts seconds
    serving = asyncio.create_task(runner_b.serve())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_a), base_url="http://a") as client:
            started = await client.post("/v1/reindex", json=dashscope_spec(fake_dashscope))
            assert started.status_code == 202, started.text
            run_id = started.json()["id"]
            for _ in range(600):  # a deadline for a loaded machine, not a speed requirement
                running = (await client.get(f"/v1/runs/{run_id}")).json()
                if running["progress"].get("chunks_embedded"):
                    break
                await asyncio.sleep(0.05)
            assert running["status"] == "running" and running["owner"] is not None
            assert (running["kind"], running["params"]["target_key"]) == ("reindex", "dashscope-text-embedding-v3-256")
            asked = await client.delete(f"/v1/runs/{run_id}")
            assert asked.status_code == 202 and asked.json()["cancel_requested"] is True
            for _ in range(600):
                ended = (await client.get("/v1/reindex")).json()
                if ended["status"] not in ("queued", "running"):
                    break
                await asyncio.sleep(0.05)
            assert (ended["id"], ended["status"], ended["error"]) == (run_id, "cancelled", CANCELLED_ON_REQUEST)
            assert 0 < ended["chunks_embedded"] < len(TOPICS)
            listed = (await client.get("/v1/runs", params={"kind": "reindex"})).json()
            assert [run["id"] for run in listed] == [run_id]
            assert (await client.delete("/v1/reindex")).status_code == 404  # nothing active any more
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await runs_a.aclose()
        await runs_b.aclose()
    assert (await space_states(runtime))[LOCAL_KEY] == ("active", True)
    response = await search(runtime, QUERIES[0])
    assert response.embedding_space == LOCAL_KEY and answer(response) == before
