"""Per-connection embedding models against a real PostgreSQL: each connection's vectors in its own model's
space, searched with its own model; changing one connection's model re-indexes it alone while search goes on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.api.reindex import connection_reindex, reindex_router, spec_model_key
from ragstream.control.kinds import reindex_kind
from ragstream.control.runner import Runner
from ragstream.credentials import CredentialCipher
from ragstream.embedding.base import TextKind, Vectors
from ragstream.embedding.spaces import ActiveSpace
from ragstream.messages import ChunkPayload, DocumentHeader
from ragstream.pipeline import EmbeddedPipeline
from ragstream.reindex import Reindexer
from ragstream.retrieval import SearchFilters, SearchRequest, SearchResponse
from ragstream.runtime import Runtime
from ragstream.settings import Settings
from ragstream.stages.embed import EmbedService, embedding_input
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.documents import document_id
from ragstream.storage.runs import RunStatus, RunStore
from ragstream.storage.spaces import RetiredSpaceError, SpaceStore
from tests.support.connections import BoundFolder
from tests.support.embedders import HashEmbedder, dashscope_spec, hash_vector, private_runtime, space_states
from tests.support.runs import in_foreground, reindex_job

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

# The fake vendors listen on 127.0.0.1.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_networks", "folder_roots")]
pytest_plugins = ["tests.support.fake_dashscope"]

LOCAL_KEY = "use-multilingual-v3-512"  # model A: the deployment's default
DASHSCOPE_KEY = "dashscope-text-embedding-v3-256"  # model B
# Words of one connection never appear in the other's: the fake's requests say whose texts it embedded.
PINNED_DOCS = {
    "install.md": "# Install\n\nDownload the package and run the installer on Linux or macOS.",
    "keys.md": "# Keys\n\nRotate API keys every ninety days; old keys stop working after a grace period.",
    "backup.md": "# Backup\n\nA nightly backup copies the database; restore it with the restore command.",
}
DEFAULT_DOCS = {
    "network.md": "# Network\n\nOpen port 8080 for the HTTP API and 9092 for the broker.",
    "logs.md": "# Logs\n\nLogs rotate daily and are kept for two weeks in the logs folder.",
    "users.md": "# Users\n\nInvite users by e-mail; an admin grants them roles and groups.",
}
QUERIES = ["install the package on linux", "rotate the api keys", "restore the nightly backup"]


@pytest.fixture
async def runtime_db(database_url: str, fake_dashscope: FakeDashScope) -> AsyncIterator[Runtime]:
    """A runtime (local model active) on a database of its own: pins and switches stay in it."""
    async with private_runtime(database_url, fake_dashscope) as runtime:
        yield runtime


async def ready() -> bool:
    return True


@asynccontextmanager
async def api(runtime: Runtime, reindexer: Reindexer) -> AsyncIterator[httpx.AsyncClient]:
    """The connections and re-index routes as ``ragstream up`` wires them, with a runner of re-index
    runs on ``reindexer``."""

    async def resolve(spec: dict[str, Any]) -> tuple[str, int]:
        embedder = await runtime.spaces.resolve(spec)
        return embedder.model_key, embedder.dimension

    runs = RunStore(runtime.pool, runtime.dsn)
    runner = Runner(runs, {"reindex": reindex_kind(reindexer)}, progress_interval_s=0.1)
    connections = ConnectionStore(runtime.pool, CredentialCipher.from_settings(Settings()))
    app = create_app(
        lambda: runtime.retriever,
        ready=ready,
        routers=[
            connections_router(
                connections,
                on_embedding_changed=connection_reindex(runs, runtime.spaces, SpaceStore(runtime.pool), runner.wake),
                resolve_embedding=resolve,
            ),
            reindex_router(runs, SpaceStore(runtime.pool), spec_model_key(runtime.spaces), runner.wake),
        ],
    )
    serving = asyncio.create_task(runner.serve())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await runs.aclose()


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


async def create(client: httpx.AsyncClient, folder: Path, embedding: dict[str, Any] | None = None) -> str:
    config: dict[str, Any] = {"path": str(folder)} | ({"embedding": embedding} if embedding else {})
    created = await client.post("/v1/connections", json={"platform": "folder", "name": folder.name, "config": config})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


async def sync(runtime: Runtime, connection_id: str, folder: Path, pipeline: EmbeddedPipeline | None = None) -> None:
    report = await (pipeline or runtime.pipeline()).sync(BoundFolder(connection_id, folder))
    assert report.ok, report.failures


async def search(runtime: Runtime, query: str, *connection_ids: str) -> SearchResponse:
    return await runtime.retriever.search(
        SearchRequest(query=query, top_k=10, filters=SearchFilters(connection_ids=list(connection_ids)))
    )


def answer(response: SearchResponse) -> list[tuple[str, int | None]]:
    return [(result.chunk_id, result.vector_rank) for result in response.results]


async def chunk_ids(runtime: Runtime, connection_id: str) -> set[str]:
    rows = await runtime.pool.fetch(
        "SELECT c.id FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1", connection_id
    )
    return {row["id"] for row in rows}


async def vectors(runtime: Runtime, model_key: str, connection_id: str) -> dict[str, list[float]]:
    """The connection's vectors in the model's table (none when the table was dropped)."""
    table = await runtime.pool.fetchval(
        "SELECT table_name FROM embedding_spaces WHERE model_key = $1 AND to_regclass(table_name) IS NOT NULL",
        model_key,
    )
    if table is None:
        return {}
    rows = await runtime.pool.fetch(
        f"SELECT e.chunk_id, e.embedding FROM {table} e JOIN chunks c ON c.id = e.chunk_id"
        " JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1",
        connection_id,
    )
    return {row["chunk_id"]: row["embedding"].to_numpy().tolist() for row in rows}


def sent(fake: FakeDashScope, kind: str) -> list[str]:
    """Texts the fake embedded as ``kind`` (document or query)."""
    return [
        text
        for request in fake.received
        if isinstance(request.body, dict) and request.body.get("parameters", {}).get("text_type") == kind
        for text in request.body["input"]["texts"]
    ]


async def test_each_connection_indexes_and_searches_with_its_own_model(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    pinned_folder = write(tmp_path / "pinned", PINNED_DOCS)
    default_folder = write(tmp_path / "default", DEFAULT_DOCS)
    async with api(runtime, runtime.reindexer()) as client:
        pinned = await create(client, pinned_folder, dashscope_spec(fake_dashscope))
        default = await create(client, default_folder)
        shown = (await client.get(f"/v1/connections/{pinned}")).json()["config"]["embedding"]
        assert shown == dashscope_spec(fake_dashscope)
    await sync(runtime, pinned, pinned_folder)
    await sync(runtime, default, default_folder)

    # Each connection's vectors are in its own model's table only.
    assert set(await vectors(runtime, DASHSCOPE_KEY, pinned)) == await chunk_ids(runtime, pinned)
    assert await vectors(runtime, LOCAL_KEY, pinned) == {}
    assert set(await vectors(runtime, LOCAL_KEY, default)) == await chunk_ids(runtime, default)
    assert await vectors(runtime, DASHSCOPE_KEY, default) == {}
    documents = sent(fake_dashscope, "document")
    assert len(documents) == len(PINNED_DOCS) and not any("broker" in text or "admin" in text for text in documents)

    # A search over both runs one leg per model, the query embedded once by each.
    fake_dashscope.received.clear()
    both = await search(runtime, "rotate the keys and open the port", pinned, default)
    assert both.embedding_spaces == [LOCAL_KEY, DASHSCOPE_KEY] and both.embedding_space == LOCAL_KEY
    assert sent(fake_dashscope, "query") == ["rotate the keys and open the port"]
    found = {(result.connection_id, result.embedding_space) for result in both.results if result.vector_rank}
    assert found == {(pinned, DASHSCOPE_KEY), (default, LOCAL_KEY)}
    ranks = sorted(result.vector_rank for result in both.results if result.vector_rank)
    assert ranks == list(range(1, len(PINNED_DOCS) + len(DEFAULT_DOCS) + 1))  # one merged vector ranking

    # The default connection's chunks get B vectors too, as a running re-index of it would store them:
    # B's leg must not return them (nor its similarities), they are searched in A until a switch.
    embedder = await runtime.spaces.resolve(dashscope_spec(fake_dashscope))
    store = SpaceStore(runtime.pool)
    table = str(
        await runtime.pool.fetchval("SELECT table_name FROM embedding_spaces WHERE model_key = $1", DASHSCOPE_KEY)
    )
    building = await store.missing(table, "", 100, default)
    assert len(building) == len(DEFAULT_DOCS)
    texts = [embedding_input(chunk.title, chunk.heading, chunk.text) for chunk in building]
    await store.store(table, [chunk.chunk_id for chunk in building], await embedder.embed(texts))
    again = await search(runtime, "rotate the keys and open the port", pinned, default)
    assert answer(again) == answer(both)
    assert {(r.connection_id, r.embedding_space) for r in again.results if r.vector_rank} == found

    # A connection's own query goes to its own model only.
    local = runtime.embedder.embed
    queries_a: list[str] = []

    async def counted(texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        queries_a.extend(texts if kind == "query" else [])
        return await local(texts, kind)

    runtime.embedder.embed = counted  # type: ignore[method-assign]
    fake_dashscope.received.clear()
    alone = await search(runtime, "open the port", default)
    assert alone.embedding_spaces == [LOCAL_KEY] and sent(fake_dashscope, "query") == []
    own = await search(runtime, "rotate the keys", pinned)
    assert own.embedding_spaces == [DASHSCOPE_KEY] and sent(fake_dashscope, "query") == ["rotate the keys"]
    assert own.results[0].source == "keys.md" and own.results[0].vector_rank == 1
    assert queries_a == ["open the port"]


async def test_changing_a_connections_model_reindexes_it_alone_while_search_goes_on(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    moving_folder = write(tmp_path / "moving", PINNED_DOCS)
    other_folder = write(tmp_path / "other", DEFAULT_DOCS)
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=1)
    async with api(runtime, reindexer) as client:
        moving = await create(client, moving_folder)
        other = await create(client, other_folder)
        await sync(runtime, moving, moving_folder)
        await sync(runtime, other, other_folder)
        other_before = await vectors(runtime, LOCAL_KEY, other)
        fake_dashscope.delay_s = 0.5  # a re-index that takes a while: searches run all through it
        path = f"/v1/connections/{moving}"
        patched = await client.patch(path, json={"config": {"embedding": dashscope_spec(fake_dashscope)}})
        assert patched.status_code == 200, patched.text
        assert "embedding" not in patched.json()["config"]  # shown once switched
        busy = await client.patch(path, json={"config": {"embedding": dashscope_spec(fake_dashscope)}})
        assert busy.status_code == 409
        # An edit committed during the rebuild, with the model still in use (A).
        write(moving_folder, {"keys.md": "# Keys\n\nKeys of the aardvark vault never expire."})
        await sync(runtime, moving, moving_folder)
        assert (await client.get(f"{path}/reindex")).json()["status"] in ("queued", "running")
        searched = {query: await search(runtime, query, moving) for query in QUERIES}
        assert all(response.embedding_spaces == [LOCAL_KEY] for response in searched.values())
        before = {query: answer(response) for query, response in searched.items()}
        seen: list[tuple[str, list[str], set[str | None], list[tuple[str, int | None]]]] = []
        progress: list[dict[str, Any]] = []

        async def finished() -> bool:
            body = (await client.get(f"{path}/reindex")).json()
            progress.append(body)
            return body["status"] not in ("queued", "running")

        async def keep_searching(offset: int, scope: tuple[str, ...]) -> None:
            """Until a few searches after the switch; several loops at once."""
            after_switch = 0
            while after_switch < len(QUERIES):
                done = await finished()
                query = QUERIES[(len(seen) + offset) % len(QUERIES)]
                response = await search(runtime, query, *scope)  # never raises
                mine = {result.embedding_space for result in response.results if result.connection_id == moving}
                seen.append((query, response.embedding_spaces, mine, answer(response) if scope == (moving,) else []))
                after_switch += done

        await asyncio.gather(
            keep_searching(0, (moving,)), keep_searching(1, (moving,)), keep_searching(2, (moving, other))
        )
        run = progress[-1]
        assert run["status"] == "succeeded", run
        assert run["connection_id"] == moving and (run["source_key"], run["target_key"]) == (LOCAL_KEY, DASHSCOPE_KEY)
        assert run["chunks_embedded"] == run["chunks_total"] == len(PINNED_DOCS)
        assert any(body["rate"] and body["eta_seconds"] is not None for body in progress if body["status"] == "running")
        shown = (await client.get(path)).json()["config"]["embedding"]
        assert shown == dashscope_spec(fake_dashscope)
    after = {query: answer(await search(runtime, query, moving)) for query in QUERIES}
    for query, models, mine, got in seen:
        assert len(mine) <= 1, (models, mine)  # one model per search for the connection
        if got:  # searches of the moving connection alone: exactly one model's whole answer
            assert models in ([LOCAL_KEY], [DASHSCOPE_KEY])
            assert got == (before if models == [LOCAL_KEY] else after)[query], models
    assert {tuple(models) for _, models, _, got in seen if got} == {(LOCAL_KEY,), (DASHSCOPE_KEY,)}
    # The switched connection: vectors in B only; the other one untouched, never sent to B.
    assert set(await vectors(runtime, DASHSCOPE_KEY, moving)) == await chunk_ids(runtime, moving)
    assert await vectors(runtime, LOCAL_KEY, moving) == {}
    assert await vectors(runtime, LOCAL_KEY, other) == other_before
    assert not any("broker" in text or "admin" in text for text in sent(fake_dashscope, "document"))
    # The edit made during the rebuild is searchable with the new model.
    edited = await search(runtime, "aardvark vault", moving)
    assert edited.embedding_spaces == [DASHSCOPE_KEY]
    assert edited.results[0].text.endswith("never expire.") and edited.results[0].vector_rank == 1
    assert await space_states(runtime) == {LOCAL_KEY: ("active", True), DASHSCOPE_KEY: ("idle", True)}


async def test_stale_vectors_of_a_switched_connection_are_refused_then_land_re_embedded(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    folder = write(tmp_path / "docs", PINNED_DOCS)
    async with api(runtime, runtime.reindexer()) as client:
        connection = await create(client, folder)
    await sync(runtime, connection, folder)
    # Another process's embed stage, which read the connection's model (A) before the switch.
    stale = ActiveSpace(SpaceStore(runtime.pool), runtime.settings.embedding, runtime.embedder, ttl_s=3600)
    assert (await stale.for_connection(connection)).model_key == LOCAL_KEY
    assert runtime.settings.database_url is not None
    env = {
        **os.environ,
        "DATABASE_URL": runtime.settings.database_url,
        "RAGSTREAM_EMBEDDER_API_KEY": fake_dashscope.api_key,
        "COLUMNS": "160",
    }
    spec = dashscope_spec(fake_dashscope)
    options = ["--provider", "dashscope", "--model", "text-embedding-v3", "--dimension", "256"]
    command = [sys.executable, "-m", "ragstream.cli", "reindex", "--connection", connection, *options]
    done = await asyncio.to_thread(
        subprocess.run,
        [*command, "--base-url", spec["base_url"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"{len(PINNED_DOCS)}/{len(PINNED_DOCS)}" in done.stderr and DASHSCOPE_KEY in done.stderr

    # A commit of model-A vectors for the switched connection is refused, retryably.
    header = DocumentHeader(
        document_id=document_id(connection, "late.md"),
        connection_id=connection,
        external_id="late.md",
        version=await runtime.store.next_version(),
        content_hash="h",
        title="late.md",
        source="late.md",
        media_type="text/markdown",
    )
    chunk = ChunkPayload(ordinal=0, heading="", text="late")
    with pytest.raises(RetiredSpaceError):
        await runtime.store.commit_document(
            header, [chunk], hash_vector("late", runtime.embedder.dimension)[None, :], LOCAL_KEY
        )
    # With the connection's model, the same document lands.
    embedder = await runtime.spaces.resolve(dashscope_spec(fake_dashscope))
    await runtime.store.commit_document(header, [chunk], await embedder.embed(["late"]), DASHSCOPE_KEY)
    # The stale process's pipeline: refused once, embedded again with B at once, and committed.
    pipeline = EmbeddedPipeline(
        runtime.store,
        runtime.chunker,
        EmbedService(runtime.embedder, stale),
        runtime.indexer,
        max_document_bytes=runtime.settings.max_document_bytes,
        retry=runtime.stage_retry(),
    )
    write(folder, {"keys.md": "# Keys\n\nKeys of the aardvark vault never expire."})
    await sync(runtime, connection, folder, pipeline)
    assert (await stale.for_connection(connection)).model_key == DASHSCOPE_KEY
    assert set(await vectors(runtime, DASHSCOPE_KEY, connection)) == await chunk_ids(runtime, connection)
    edited = await search(runtime, "aardvark vault", connection)
    assert edited.results[0].text.endswith("never expire.") and edited.results[0].vector_rank == 1
    await stale.aclose()


async def test_a_deployment_wide_reindex_leaves_pinned_connections_and_their_tables_alone(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    folders = {name: write(tmp_path / name, DEFAULT_DOCS) for name in ("follower", "on_b", "on_a")}
    async with api(runtime, runtime.reindexer()) as client:
        follower = await create(client, folders["follower"])
        on_b = await create(client, folders["on_b"], dashscope_spec(fake_dashscope))
        on_a = await create(client, folders["on_a"], {"provider": "local"})  # pinned to the default model
    for connection, folder in ((follower, folders["follower"]), (on_b, folders["on_b"]), (on_a, folders["on_a"])):
        await sync(runtime, connection, folder)
    kept = {on_b: await vectors(runtime, DASHSCOPE_KEY, on_b), on_a: await vectors(runtime, LOCAL_KEY, on_a)}
    assert all(len(found) == len(DEFAULT_DOCS) for found in kept.values())
    fake_dashscope.received.clear()
    target = HashEmbedder()
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=2)
    job = reindex_job(reindexer, target, {"provider": "local"})
    run = (await in_foreground(runtime.pool, runtime.dsn, "reindex", None, {"spec": {"provider": "local"}}, job)).run
    assert run is not None and run.status is RunStatus.SUCCEEDED, run
    # Only the follower's chunks were re-embedded; the pinned ones kept their vectors and tables.
    assert run.progress["chunks_total"] == run.progress["chunks_embedded"] == len(DEFAULT_DOCS)
    assert len(target.texts) == len(DEFAULT_DOCS) and sent(fake_dashscope, "document") == []
    assert await vectors(runtime, DASHSCOPE_KEY, on_b) == kept[on_b]
    assert await vectors(runtime, LOCAL_KEY, on_a) == kept[on_a]
    assert await vectors(runtime, LOCAL_KEY, follower) == {}  # the old default keeps only its pinned one
    assert set(await vectors(runtime, target.model_key, follower)) == await chunk_ids(runtime, follower)
    assert await space_states(runtime) == {
        LOCAL_KEY: ("idle", True),
        DASHSCOPE_KEY: ("idle", True),
        target.model_key: ("active", True),
    }
    response = await search(runtime, "open the port for the broker", follower, on_b, on_a)
    assert response.embedding_spaces == [target.model_key, DASHSCOPE_KEY, LOCAL_KEY]  # the default first
    assert {(r.connection_id, r.embedding_space) for r in response.results if r.vector_rank} == {
        (follower, target.model_key),
        (on_b, DASHSCOPE_KEY),
        (on_a, LOCAL_KEY),
    }


async def test_a_cancelled_change_resumes_and_null_goes_back_to_the_default_dropping_the_unused_table(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    folder = write(tmp_path / "docs", PINNED_DOCS)
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces, batch_size=1)
    async with api(runtime, reindexer) as client:
        connection = await create(client, folder)
        await sync(runtime, connection, folder)
        path = f"/v1/connections/{connection}"
        assert (await client.get(f"{path}/reindex")).status_code == 404
        fake_dashscope.delay_s = 0.5
        patch = {"config": {"embedding": dashscope_spec(fake_dashscope)}}
        assert (await client.patch(path, json=patch)).status_code == 200
        assert (await client.delete(f"{path}/reindex")).status_code == 202
        cancelled = await settled(client, f"{path}/reindex")
        assert (cancelled["status"], cancelled["error"]) == ("cancelled", "cancelled on request")
        assert (await client.delete(f"{path}/reindex")).status_code == 404  # nothing runs any more
        assert "embedding" not in (await client.get(path)).json()["config"]
        assert (await search(runtime, "rotate the keys", connection)).embedding_spaces == [LOCAL_KEY]

        fake_dashscope.delay_s = 0.0
        assert (await client.patch(path, json=patch)).status_code == 200  # resumes
        body = await settled(client, f"{path}/reindex")
        assert body["status"] == "succeeded" and body["chunks_embedded"] == len(PINNED_DOCS)
        assert (await search(runtime, "rotate the keys", connection)).embedding_spaces == [DASHSCOPE_KEY]

        # null: back to the default model, by the same mechanism; B's table serves nobody any more.
        assert (await client.patch(path, json={"config": {"embedding": None}})).status_code == 200
        body = await settled(client, f"{path}/reindex")
        assert body["status"] == "succeeded", body
        assert (body["source_key"], body["target_key"]) == (DASHSCOPE_KEY, LOCAL_KEY)
        assert "embedding" not in (await client.get(path)).json()["config"]
    assert set(await vectors(runtime, LOCAL_KEY, connection)) == await chunk_ids(runtime, connection)
    assert await space_states(runtime) == {LOCAL_KEY: ("active", True), DASHSCOPE_KEY: ("retired", False)}
    response = await search(runtime, "rotate the keys", connection)
    assert response.embedding_spaces == [LOCAL_KEY] and response.results[0].vector_rank == 1


async def settled(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    """The run at ``path`` once it is neither queued nor running."""
    for _ in range(300):
        body: dict[str, Any] = (await client.get(path)).json()
        if body["status"] not in ("queued", "running"):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} still running")


async def test_deleting_the_last_connection_pinned_to_a_model_drops_its_table(
    runtime_db: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    runtime = runtime_db
    reindexer = Reindexer(SpaceStore(runtime.pool), runtime.spaces)
    async with api(runtime, reindexer) as client:
        first = await create(client, write(tmp_path / "first", PINNED_DOCS), dashscope_spec(fake_dashscope))
        second = await create(client, write(tmp_path / "second", PINNED_DOCS), dashscope_spec(fake_dashscope))
        await sync(runtime, first, tmp_path / "first")
        await sync(runtime, second, tmp_path / "second")
        assert (await client.delete(f"/v1/connections/{first}")).status_code == 204
        assert await space_states(runtime) == {LOCAL_KEY: ("active", True), DASHSCOPE_KEY: ("idle", True)}
        assert set(await vectors(runtime, DASHSCOPE_KEY, second)) == await chunk_ids(runtime, second)
        assert (await client.delete(f"/v1/connections/{second}")).status_code == 204
    assert await space_states(runtime) == {LOCAL_KEY: ("active", True), DASHSCOPE_KEY: ("retired", False)}
