"""Re-chunk a connection with a new chunking config against a real PostgreSQL: search goes on, one config per search."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.api.rechunk import connection_rechunk, rechunk_router
from ragstream.chunking import ChunkingConfig, MarkdownChunking, RecursiveChunking
from ragstream.connectors.folder import FolderConnector
from ragstream.control.kinds import rechunk_kind
from ragstream.control.runner import CANCELLED_ON_REQUEST, PROCESS_STOPPED, Runner
from ragstream.core.search import SearchFilters
from ragstream.credentials import CredentialCipher
from ragstream.jobs.progress import RunProgress
from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentHeader, DocumentIndexed
from ragstream.pipeline import EmbeddedPipeline
from ragstream.rechunk import Rechunker
from ragstream.retrieval import SearchRequest
from ragstream.runtime import Runtime
from ragstream.settings import Settings
from ragstream.stages.index import IndexService
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.documents import StaleChunkingError, document_id
from ragstream.storage.rechunk import RebuiltChunks, RechunkDocument, RechunkStore
from ragstream.storage.runs import Run, RunStatus, RunStore
from ragstream.storage.spaces import SpaceStore
from tests.support.runs import in_foreground

pytestmark = pytest.mark.integration

NEW = RecursiveChunking(size=200, overlap=0)
TOPICS = [
    ("install", "Download the package and run the installer on Linux or macOS."),
    ("keys", "Rotate API keys every ninety days; old keys stop working after a grace period."),
    ("backup", "A nightly backup copies the database; restore it with the restore command."),
    ("network", "Open port 8080 for the HTTP API and 9092 for the broker on every node."),
    ("logs", "Logs rotate daily and are kept for two weeks in the logs folder of the server."),
    ("users", "Invite users by e-mail; an admin grants them roles and groups in the console."),
    ("billing", "Invoices are issued monthly and paid by card or bank transfer within thirty days."),
    ("alerts", "Alerts page the on-call engineer when the error rate stays above one percent."),
]
QUERIES = ["install the server on linux", "rotate the api keys", "restore the database backup", "invoices paid by card"]


def document(topic: str, sentence: str, *, extra: str = "") -> str:
    """Several paragraphs: one chunk under the default Markdown config, several under ``NEW``."""
    paragraphs = [f"{sentence} Step {step} of the {topic} guide explains this in detail." for step in range(1, 6)]
    return f"# {topic.title()}\n\n" + "\n\n".join(paragraphs) + (f"\n\n{extra}" if extra else "")


def write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


async def sync(runtime: Runtime, folder: Path) -> None:
    report = await runtime.pipeline().sync(FolderConnector(folder))
    assert report.ok, report.failures


@pytest.fixture
async def corpus_connection(runtime: Runtime, tmp_path: Path) -> tuple[Path, str]:
    """A folder connection with every topic indexed under the default (Markdown) chunking."""
    folder = tmp_path / "docs"
    write(folder, {f"{topic}.md": document(topic, sentence) for topic, sentence in TOPICS})
    await sync(runtime, folder)
    return folder, FolderConnector(folder).connection_id


@pytest.fixture
async def tasks() -> AsyncIterator[list[asyncio.Task[Run]]]:
    """Runs a test starts in the background, cancelled if the test fails while they wait: a paused run
    would hold its pool connection and block the session's runtime from closing."""
    started: list[asyncio.Task[Run]] = []
    yield started
    for task in started:
        task.cancel()
    await asyncio.gather(*started, return_exceptions=True)


class PausingStore(RechunkStore):
    """The real store, counting the documents a run stores and holding the ``pause_at``-th one until
    ``resume`` is set: a rebuild that takes a while, with a known number of documents done."""

    def __init__(self, runtime: Runtime, *, pause_at: int | None = None, delay_s: float = 0.0) -> None:
        super().__init__(runtime.pool)
        self.pause_at = pause_at
        self.delay_s = delay_s
        self.stored: list[str] = []
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()

    async def store(self, document: RechunkDocument, index_version: int, rebuilt: RebuiltChunks) -> bool:
        if len(self.stored) + 1 == self.pause_at:
            self.paused.set()
            await asyncio.wait_for(self.resume.wait(), 60)
        await asyncio.sleep(self.delay_s)
        self.stored.append(document.document_id)
        return await super().store(document, index_version, rebuilt)


def rechunker(runtime: Runtime, store: RechunkStore) -> Rechunker:
    return Rechunker(store, runtime.chunker, runtime.spaces, batch_size=3)


async def rechunk(
    runtime: Runtime,
    store: RechunkStore,
    connection_id: str,
    config: ChunkingConfig,
    *,
    progress_interval_s: float = 2.0,
    observe: Callable[[RunProgress], None] | None = None,
) -> Run:
    """A re-chunk run to its end, as ``ragstream rechunk`` runs one: its final row."""
    outcome = await in_foreground(
        runtime.pool,
        runtime.dsn,
        "rechunk",
        connection_id,
        {"chunking": config.model_dump(mode="json")},
        rechunk_kind(rechunker(runtime, store)),
        progress_interval_s=progress_interval_s,
        observe=observe,
    )
    assert outcome.run is not None
    return outcome.run


async def search_ids(runtime: Runtime, connection_id: str, query: str) -> list[str]:
    response = await runtime.retriever.search(
        SearchRequest(query=query, top_k=10, filters=SearchFilters(connection_ids=[connection_id]))
    )
    return [result.chunk_id for result in response.results]


async def chunk_rows(runtime: Runtime, connection_id: str) -> dict[str, list[tuple[int, str, str, int]]]:
    """Every chunk of the connection by document source: (ordinal, heading, text, index version)."""
    rows = await runtime.pool.fetch(
        "SELECT d.source, c.ordinal, c.heading, c.text, c.index_version FROM chunks c"
        " JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1 ORDER BY d.source, c.index_version,"
        " c.ordinal",
        connection_id,
    )
    found: dict[str, list[tuple[int, str, str, int]]] = {}
    for row in rows:
        found.setdefault(row["source"], []).append((row["ordinal"], row["heading"], row["text"], row["index_version"]))
    return found


async def expected_chunks(runtime: Runtime, text: str, config: ChunkingConfig) -> list[tuple[int, str, str]]:
    """What ingest would store for this content under ``config``."""
    chunker = await runtime.chunker.chunker(config)
    _, chunks = await runtime.chunker.chunk(text.encode(), "text/markdown", "", chunker)
    return [(chunk.ordinal, chunk.heading, chunk.text) for chunk in chunks]


async def connection_ids(runtime: Runtime, connection_id: str) -> set[str]:
    rows = await runtime.pool.fetch(
        "SELECT c.id FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1", connection_id
    )
    return {row["id"] for row in rows}


async def assert_one_clean_version(runtime: Runtime, connection_id: str, files: dict[str, str]) -> None:
    """Only chunks of the active version, exactly what ``NEW`` makes of each file, each with one vector."""
    active = await runtime.pool.fetchval("SELECT index_version FROM connections WHERE id = $1", connection_id)
    found = await chunk_rows(runtime, connection_id)
    assert set(found) == set(files)
    for name, text in files.items():
        assert {version for *_, version in found[name]} == {active}, name
        assert [row[:3] for row in found[name]] == await expected_chunks(runtime, text, NEW), name
    space = await SpaceStore(runtime.pool).active()
    assert space is not None
    vectors = await runtime.pool.fetchval(
        f"SELECT count(*) FROM {space.table} e JOIN chunks c ON c.id = e.chunk_id JOIN documents d"
        " ON d.id = c.document_id WHERE d.connection_id = $1",
        connection_id,
    )
    assert vectors == sum(len(rows) for rows in found.values())


async def test_searches_during_a_rechunk_never_fail_nor_mix_old_and_new_chunks(
    runtime: Runtime, corpus_connection: tuple[Path, str], tasks: list[asyncio.Task[Run]]
) -> None:
    folder, connection = corpus_connection
    files = {path.name: path.read_text(encoding="utf-8") for path in folder.iterdir()}
    old_ids = await connection_ids(runtime, connection)
    assert len(old_ids) == len(TOPICS)  # one Markdown chunk per document
    before = {query: await search_ids(runtime, connection, query) for query in QUERIES}
    store = PausingStore(runtime, delay_s=0.1)
    progress: list[RunProgress] = []
    task = asyncio.create_task(rechunk(runtime, store, connection, NEW, observe=progress.append))
    tasks.append(task)
    seen: list[tuple[str, list[str]]] = []

    async def keep_searching(offset: int) -> None:
        after_switch = 0
        while after_switch < len(QUERIES):
            query = QUERIES[(len(seen) + offset) % len(QUERIES)]
            seen.append((query, await search_ids(runtime, connection, query)))  # never raises
            after_switch += task.done()

    await asyncio.gather(*(keep_searching(offset) for offset in range(3)))
    result = await task
    assert result.status is RunStatus.SUCCEEDED, result.error
    new_ids = await connection_ids(runtime, connection)
    assert not new_ids & old_ids and len(new_ids) > len(old_ids)
    old_searches = [query for query, ids in seen if set(ids) <= old_ids]
    assert all(ids and (set(ids) <= old_ids or set(ids) <= new_ids) for _, ids in seen)
    assert len(old_searches) > len(QUERIES) and len(old_searches) < len(seen)  # searched while it built, and after
    for query, ids in seen:
        if set(ids) <= old_ids:
            assert ids == before[query]
    await assert_one_clean_version(runtime, connection, files)
    stored = await runtime.pool.fetchval("SELECT config -> 'chunking' FROM connections WHERE id = $1", connection)
    assert stored is not None and RecursiveChunking.model_validate_json(stored) == NEW
    assert len(store.stored) == len(TOPICS)  # each document rebuilt once
    assert result.progress["documents_done"] == result.progress["documents_total"] == len(TOPICS)
    assert result.progress["chunks"] == len(new_ids) and progress[-1].done == len(TOPICS)
    assert result.progress["eta_seconds"] is None and result.finished_at is not None
    # Ingest from now on chunks with the new config, at the new version.
    write(folder, {"install.md": document("install", TOPICS[0][1], extra="Also supports FreeBSD jails.")})
    await sync(runtime, folder)
    files["install.md"] = (folder / "install.md").read_text(encoding="utf-8")
    await assert_one_clean_version(runtime, connection, files)


async def test_documents_edited_during_a_rechunk_are_right_after_the_switch(
    runtime: Runtime, corpus_connection: tuple[Path, str], tmp_path: Path, tasks: list[asyncio.Task[Run]]
) -> None:
    folder, connection = corpus_connection
    store = PausingStore(runtime, pause_at=3)  # two documents rebuilt, the third held
    task = asyncio.create_task(rechunk(runtime, store, connection, NEW))
    tasks.append(task)
    await store.paused.wait()
    order = sorted((document_id(connection, f"{topic}.md"), f"{topic}.md") for topic, _ in TOPICS)
    rebuilt, held, untouched = order[0][1], order[2][1], order[-1][1]
    assert [doc for doc, _ in order[:2]] == store.stored
    edits = {
        rebuilt: document("edited", "Aardvark vaults keep the rebuilt document's new content."),
        held: document("held", "Quokka habitats replace the held document's content."),
        untouched: document("later", "Zephyr dashboards replace a document not rebuilt yet."),
        "added.md": document("added", "Narwhal tusks are in a document added during the rebuild."),
    }
    write(folder, edits)
    deleted = order[3][1]
    (folder / deleted).unlink()
    await sync(runtime, folder)  # commits with the old config, at the old version
    during = await chunk_rows(runtime, connection)
    assert deleted not in during
    for name in edits:
        assert {version for *_, version in during[name]} == {0}, name  # only the old version: rebuilt again later
    assert len(await search_ids(runtime, connection, "aardvark vaults")) > 0
    store.resume.set()
    result = await task
    assert result.status is RunStatus.SUCCEEDED, result.error
    files = {path.name: path.read_text(encoding="utf-8") for path in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)
    for query, name in [("aardvark vaults", rebuilt), ("quokka habitats", held), ("narwhal tusks", "added.md")]:
        response = await runtime.retriever.search(
            SearchRequest(query=query, top_k=1, filters=SearchFilters(connection_ids=[connection]))
        )
        assert response.results[0].source == name and len(response.results[0].text) <= NEW.size
    # A document chunked for the old version but committed after the switch is refused, to be chunked again.
    header = DocumentHeader(
        document_id=document_id(connection, "late.md"),
        connection_id=connection,
        external_id="late.md",
        version=await runtime.store.next_version(),
        content_hash="h",
        title="late",
        source="late.md",
        media_type="text/markdown",
    )
    vectors = await runtime.embedder.embed(["late"])
    chunk = ChunkPayload(ordinal=0, heading="", text="late")
    with pytest.raises(StaleChunkingError):
        await runtime.store.commit_document(header, [chunk], vectors, runtime.embedder.model_key, 0)


class SwitchingIndexer(IndexService):
    """The real index stage, which lets a whole re-chunk run and switch before its first commit: the
    document was chunked with the old config and commits after the switch."""

    def __init__(self, runtime: Runtime, connection_id: str) -> None:
        super().__init__(runtime.store)
        self._runtime = runtime
        self._connection_id = connection_id
        self.results: list[Run] = []

    async def run(self, message: ChunksEmbedded) -> DocumentIndexed | None:
        if not self.results:
            self.results.append(
                await rechunk(self._runtime, RechunkStore(self._runtime.pool), self._connection_id, NEW)
            )
        return await super().run(message)


async def test_a_document_chunked_before_the_switch_and_committed_after_is_chunked_again(
    runtime: Runtime, corpus_connection: tuple[Path, str]
) -> None:
    folder, connection = corpus_connection
    indexer = SwitchingIndexer(runtime, connection)
    pipeline = EmbeddedPipeline(
        runtime.store, runtime.chunker, runtime.embed, indexer, max_document_bytes=runtime.settings.max_document_bytes
    )
    write(folder, {"late.md": document("late", "Pangolin scales arrive while the re-chunk switches.")})
    report = await pipeline.sync(FolderConnector(folder))
    assert report.ok, report.failures
    assert report.progress.indexed == 1 and [result.status for result in indexer.results] == [RunStatus.SUCCEEDED]
    files = {file.name: file.read_text(encoding="utf-8") for file in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)


async def test_a_cancelled_rechunk_keeps_the_old_chunks_and_resumes(
    runtime: Runtime, corpus_connection: tuple[Path, str], tasks: list[asyncio.Task[Run]]
) -> None:
    folder, connection = corpus_connection
    old_ids = await connection_ids(runtime, connection)
    before = await search_ids(runtime, connection, QUERIES[0])
    first = PausingStore(runtime, pause_at=5)  # four documents stored, the fifth held: then cancelled
    task = asyncio.create_task(rechunk(runtime, first, connection, NEW, progress_interval_s=0.1))
    tasks.append(task)
    await first.paused.wait()
    await asyncio.sleep(0.3)  # stuck, yet progress is written
    other = RunStore(runtime.pool, runtime.dsn)  # another replica's: it never owned the run
    running = await other.latest(connection, kind="rechunk")
    assert running is not None and running.status is RunStatus.RUNNING and running.heartbeat_at is not None
    counts = running.progress
    assert (counts["documents_total"], counts["documents_done"]) == (len(TOPICS), 4) and counts["chunks"] > 4
    assert counts["rate"] and counts["eta_seconds"] and (datetime.now(UTC) - running.heartbeat_at).total_seconds() < 1
    await other.request_cancel(running.id)
    await other.aclose()
    run = await task
    assert (run.status, run.error, run.progress["documents_done"]) == (RunStatus.CANCELLED, CANCELLED_ON_REQUEST, 4)
    assert await search_ids(runtime, connection, QUERIES[0]) == before
    assert (await connection_ids(runtime, connection)) > old_ids  # the new version's first documents wait

    second = PausingStore(runtime)
    result = await rechunk(runtime, second, connection, NEW)
    assert result.status is RunStatus.SUCCEEDED and result.params["index_version"] == run.params["index_version"]
    assert len(second.stored) == len(TOPICS) - 4 and not set(second.stored) & set(first.stored[:4])
    assert result.progress["documents_done"] == len(TOPICS)
    files = {path.name: path.read_text(encoding="utf-8") for path in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)


async def test_a_rechunk_with_another_config_drops_the_abandoned_version(
    runtime: Runtime, corpus_connection: tuple[Path, str], tasks: list[asyncio.Task[Run]]
) -> None:
    folder, connection = corpus_connection
    first = PausingStore(runtime, pause_at=3)
    task = asyncio.create_task(rechunk(runtime, first, connection, RecursiveChunking(size=400, overlap=0)))
    tasks.append(task)
    await first.paused.wait()
    task.cancel()  # the process stops
    await asyncio.gather(task, return_exceptions=True)
    abandoned = await RunStore(runtime.pool, runtime.dsn).latest(connection, kind="rechunk")
    assert abandoned is not None and (abandoned.status, abandoned.error) == (RunStatus.FAILED, PROCESS_STOPPED)
    second = PausingStore(runtime)
    result = await rechunk(runtime, second, connection, NEW)
    assert result.status is RunStatus.SUCCEEDED
    assert result.params["index_version"] == abandoned.params["index_version"] + 1
    assert len(second.stored) == len(TOPICS)
    files = {path.name: path.read_text(encoding="utf-8") for path in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)


async def test_a_document_without_staged_content_fails_the_run_and_keeps_the_old_chunks(
    runtime: Runtime, corpus_connection: tuple[Path, str]
) -> None:
    _, connection = corpus_connection
    before = await search_ids(runtime, connection, QUERIES[0])
    await runtime.pool.execute(
        "DELETE FROM staged_documents s USING documents d WHERE d.id = s.document_id AND d.version = s.version"
        " AND d.id = $1",
        document_id(connection, "keys.md"),
    )
    result = await rechunk(runtime, RechunkStore(runtime.pool), connection, NEW)
    assert result.status is RunStatus.FAILED and result.error is not None and "keys" in result.error
    assert "no longer staged" in result.error and result.progress["documents_failed"] == 1
    assert await search_ids(runtime, connection, QUERIES[0]) == before
    assert await runtime.pool.fetchval("SELECT index_version FROM connections WHERE id = $1", connection) == 0


async def test_patching_the_chunking_config_rechunks_in_the_background(
    runtime: Runtime, corpus_connection: tuple[Path, str]
) -> None:
    folder, connection = corpus_connection
    store = PausingStore(runtime, delay_s=0.2)
    runs = RunStore(runtime.pool, runtime.dsn)
    runner = Runner(runs, {"rechunk": rechunk_kind(rechunker(runtime, store))}, progress_interval_s=0.1)
    connections = ConnectionStore(runtime.pool, CredentialCipher.from_settings(Settings()))

    async def ready() -> bool:
        return True

    app = create_app(
        lambda: runtime.retriever,
        ready=ready,
        routers=[
            connections_router(connections, on_chunking_changed=connection_rechunk(runs, runner.wake)),
            rechunk_router(runs, runner.wake),
        ],
    )
    path = f"/v1/connections/{connection}"
    serving = asyncio.create_task(runner.serve())

    async def settled() -> dict[str, Any]:
        for _ in range(200):  # a deadline for a loaded machine, not a speed requirement
            body: dict[str, Any] = (await client.get(f"{path}/rechunk")).json()
            if body["status"] not in ("queued", "running"):
                return body
            await asyncio.sleep(0.1)
        raise AssertionError(f"{path}/rechunk still active")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get(f"{path}/rechunk")).status_code == 404
        patched = await client.patch(path, json={"config": {"chunking": NEW.model_dump()}, "name": "renamed"})
        assert patched.status_code == 200, patched.text
        assert patched.json()["name"] == "renamed" and "chunking" not in patched.json()["config"]
        running = (await client.get(f"{path}/rechunk")).json()
        assert running["status"] in ("queued", "running")
        again = await client.patch(path, json={"config": {"chunking": NEW.model_dump()}})
        assert again.status_code == 409
        busy = await client.post(f"{path}/rechunk", json={"chunking": NEW.model_dump()})
        assert busy.status_code == 409
        body = await settled()
        assert body["status"] == "succeeded" and body["documents_done"] == body["documents_total"] == len(TOPICS)
        assert body["chunks"] > len(TOPICS) and body["rate"] > 0
        shown = (await client.get(path)).json()
        assert shown["config"]["chunking"] == NEW.model_dump(mode="json")
        # The same config again changes nothing; the old one back starts another run, which can be cancelled.
        assert (await client.patch(path, json={"config": {"chunking": NEW.model_dump()}})).status_code == 200
        assert (await client.get(f"{path}/rechunk")).json()["index_version"] == body["index_version"]
        markdown = MarkdownChunking().model_dump()
        store.pause_at = len(store.stored) + 1  # the run holds its first document until cancelled
        started = await client.post(f"{path}/rechunk", json={"chunking": markdown})
        assert started.status_code == 202 and started.json()["status"] == "queued"
        await asyncio.wait_for(store.paused.wait(), 60)
        building = (await client.get(f"{path}/rechunk")).json()
        assert building["index_version"] == body["index_version"] + 1
        assert (await client.delete(f"{path}/rechunk")).status_code == 202
        cancelled = await settled()
        assert (cancelled["status"], cancelled["error"]) == ("cancelled", "cancelled on request")
        assert (await client.delete(f"{path}/rechunk")).status_code == 404
        assert (await client.post("/v1/connections/nope/rechunk", json={"chunking": markdown})).status_code == 404
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    await runs.aclose()
    files = {file.name: file.read_text(encoding="utf-8") for file in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)


SMALL_RECURSIVE = ("--chunk-size", "200", "--chunk-overlap", "0")  # makes NEW


async def cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``ragstream ARGS`` in a process of its own, on the test database, with a wide progress bar."""
    env = {**os.environ, "DATABASE_URL": database_url, "COLUMNS": "160"}
    command = [sys.executable, "-m", "ragstream.cli", *args]
    return await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True, timeout=300)


async def test_the_command_shows_progress_and_switches(
    runtime: Runtime, corpus_connection: tuple[Path, str], database_url: str
) -> None:
    folder, connection = corpus_connection
    done = await cli(database_url, "rechunk", str(folder), "--chunker", "recursive", *SMALL_RECURSIVE)
    assert done.returncode == 0, done.stderr
    assert f"{len(TOPICS)}/{len(TOPICS)}" in done.stderr and "docs/s" in done.stderr
    assert "search now uses index version" in done.stderr
    files = {file.name: file.read_text(encoding="utf-8") for file in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)
    missing = await cli(database_url, "rechunk", "nope", "--chunker", "token")
    assert missing.returncode == 1 and "cannot re-chunk" in missing.stderr


async def test_ingest_with_another_chunker_rechunks_the_indexed_files_first(
    runtime: Runtime, corpus_connection: tuple[Path, str], database_url: str
) -> None:
    folder, connection = corpus_connection
    (folder / "added.md").write_text(document("added", "A file the ingest itself indexes, with the new config."))
    done = await cli(database_url, "ingest", str(folder), "--chunker", "recursive", *SMALL_RECURSIVE)
    assert done.returncode == 0, done.stderr
    assert "search now uses index version" in done.stderr
    files = {file.name: file.read_text(encoding="utf-8") for file in folder.iterdir()}
    await assert_one_clean_version(runtime, connection, files)
    # Once stored, the same options only sync.
    again = await cli(database_url, "ingest", str(folder), "--chunker", "recursive", *SMALL_RECURSIVE)
    assert again.returncode == 0 and "re-chunk" not in again.stderr, again.stderr
