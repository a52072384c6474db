"""The five services as real processes over a real Kafka broker and PostgreSQL.

Ingest a folder, find a chunk (over HTTP and the retriever's gRPC API); edit a file, the new text is
found and the old is gone; delete a file, it is gone. Then crash consumers between their durable output
and their offset commit and show that nothing is lost and no chunk is duplicated; and replay dead
letters once their cause is gone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragstream.connectors.folder import FolderConnector
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.support.grpc_client import result_dict
from tests.support.services import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

CONSUMERS = ("chunker", "embedder", "indexer")


@pytest.fixture(scope="module")
def service_env(database_url: str, kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RAGSTREAM_KAFKA_SESSION_TIMEOUT_MS": "6000",
        "RAGSTREAM_FETCHER_INTERVAL_S": "0",
        # Every test's tmp_path is below it: the folders synced through the fetcher's API.
        "RAGSTREAM_FOLDER_ROOTS": str(tmp_path_factory.getbasetemp()),
    }


@pytest.fixture(scope="module")
def services(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServiceProcess]]:
    logs = tmp_path_factory.mktemp("service-logs")
    started: dict[str, ServiceProcess] = {}
    try:
        for name in ("connector-fetcher", *CONSUMERS, "retriever"):
            started[name] = ServiceProcess(name, service_env, logs).start(timeout=120)
        yield started
    finally:
        for process in started.values():
            process.stop()


def trigger_sync(fetcher: ServiceProcess, folder: Path, *, wait: bool = True) -> None:
    """Start a sync and, with ``wait``, return once it is ready: every change it announced is
    committed by the indexer or given up on."""
    response = httpx.post(f"{fetcher.url}/v1/syncs", json={"path": str(folder)}, timeout=10)
    assert response.status_code == 202, response.text
    if not wait:
        return
    connection = FolderConnector(folder).connection_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = httpx.get(f"{fetcher.url}/v1/syncs/{connection}", timeout=10).json()
        if status["state"] != "syncing":
            assert status["state"] == "ready", status
            return
        time.sleep(0.2)
    raise TimeoutError("the sync did not end within 60 s")


def search(retriever: ServiceProcess, folder: Path, query: str) -> list[dict[str, object]]:
    response = httpx.post(
        f"{retriever.url}/v1/search",
        json={"query": query, "filters": {"connection_ids": [FolderConnector(folder).connection_id]}},
        timeout=30,
    )
    response.raise_for_status()
    results: list[dict[str, object]] = response.json()["results"]
    return results


def wait_until(condition: Callable[[], bool], timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise TimeoutError(f"timed out waiting for {what}")


def found(retriever: ServiceProcess, folder: Path, term: str) -> list[str]:
    return [str(r["source"]) for r in search(retriever, folder, term) if term in str(r["text"])]


async def fetch_runs(database_url: str, folder: Path) -> list[tuple[str, str, int, int, int, int, int, str]]:
    """(trigger, status, listed, changed, deleted, indexed, failed, direction) of the folder's sync runs,
    oldest first."""
    connection = await asyncpg.connect(database_url)
    try:
        rows = await connection.fetch(
            "SELECT trigger, status, (progress->>'listed')::int, (progress->>'changed')::int,"
            " (progress->>'deleted')::int, (progress->>'indexed')::int, (progress->>'failed')::int,"
            " progress->>'direction' FROM runs WHERE kind = 'sync' AND connection_id = $1 ORDER BY id",
            FolderConnector(folder).connection_id,
        )
    finally:
        await connection.close()
    return [tuple(row.values()) for row in rows]


def test_ingest_edit_delete_through_kafka(
    services: dict[str, ServiceProcess], database_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "kb"
    folder.mkdir()
    (folder / "alpha.md").write_text("# Alpha\n\n## Ports\n\nThe frobnicator listens on port 7411.\n")
    (folder / "beta.md").write_text("# 贝塔\n\n## 值班\n\n值班交接在每周二上午十点进行。\n")
    fetcher, retriever = services["connector-fetcher"], services["retriever"]

    trigger_sync(fetcher, folder)
    wait_until(lambda: found(retriever, folder, "frobnicator") == ["alpha.md"], what="alpha indexed")
    wait_until(lambda: found(retriever, folder, "值班交接") == ["beta.md"], what="beta indexed")
    result = search(retriever, folder, "frobnicator port")[0]
    assert {"rank", "score", "citation_index", "document_id", "title", "source", "heading", "text"} <= set(result)
    assert (result["title"], result["source"]) == ("Alpha", "alpha.md")
    # The retriever answers the same search over gRPC, and its gRPC health says it is serving.
    with grpc.insecure_channel(f"127.0.0.1:{retriever.grpc_port}") as channel:
        request = retrieval_pb2.SearchRequest(
            query="frobnicator port",
            filters=retrieval_pb2.SearchFilters(
                connection_ids=retrieval_pb2.StringList(values=[FolderConnector(folder).connection_id])
            ),
        )
        answer = retrieval_pb2_grpc.RetrievalStub(channel).Search(request, timeout=30)
        assert [result_dict(result) for result in answer.results] == search(retriever, folder, "frobnicator port")
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    for stage, topic in (("chunker", "doc.changed"), ("embedder", "doc.chunked"), ("indexer", "chunk.embedded")):
        metrics = httpx.get(f"{services[stage].url}/metrics", timeout=10).text
        assert f'ragstream_messages_in_total{{stage="{stage}",topic="{topic}"}}' in metrics
        lag = [line for line in metrics.splitlines() if line.startswith("ragstream_consumer_lag{")]
        assert any(f'group="ragstream-{stage}"' in line and f'topic="{topic}"' in line for line in lag), lag
        assert f'ragstream_stage_seconds_count{{stage="{stage}"}}' in metrics
    assert (
        'ragstream_messages_out_total{stage="connector-fetcher",topic="doc.changed"}'
        in httpx.get(f"{fetcher.url}/metrics", timeout=10).text
    )

    (folder / "alpha.md").write_text("# Alpha\n\nThe frobnicator moved to the snorkelgate subnet.\n")
    trigger_sync(fetcher, folder)
    wait_until(lambda: found(retriever, folder, "snorkelgate") == ["alpha.md"], what="edit indexed")
    assert found(retriever, folder, "7411") == []

    (folder / "beta.md").unlink()
    trigger_sync(fetcher, folder)
    wait_until(lambda: found(retriever, folder, "值班交接") == [], what="deletion indexed")
    # Each run counts what the indexer committed, not only what the fetcher announced.
    assert asyncio.run(fetch_runs(database_url, folder)) == [
        ("api", "succeeded", 2, 2, 0, 2, 0, "backward"),
        ("api", "succeeded", 2, 1, 0, 1, 0, "forward"),
        ("api", "succeeded", 1, 0, 1, 0, 0, "forward"),
    ]


def test_html_is_cleaned_the_same_way_through_kafka(services: dict[str, ServiceProcess], tmp_path: Path) -> None:
    """The chunker service converts HTML with the parser the embedded pipeline runs: the page's title,
    its headings and text and its links' text, without navigation, scripts or link targets."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "harbor.html").write_text(
        "<html><head><title>Harbor  guide</title><script>var tracker = 1;</script></head><body>"
        "<nav>Chapter list</nav><h1>Harbor</h1><h2>Ports</h2>"
        '<p>The wharfgate listens on port 7411, see <a href="ports.html#tcp">the port table</a>.</p>'
        '<img src="diagram.png" alt="diagram"></body></html>'
    )
    trigger_sync(services["connector-fetcher"], folder)
    wait_until(lambda: found(services["retriever"], folder, "wharfgate") == ["harbor.html"], what="page indexed")
    result = search(services["retriever"], folder, "wharfgate port")[0]
    assert result["title"] == "Harbor guide" and str(result["heading"]).startswith("Harbor")
    text = str(result["text"])
    assert "The wharfgate listens on port 7411, see the port table." in text
    for dropped in ("Chapter list", "tracker", "ports.html", "diagram.png", "]("):
        assert dropped not in text


def connection_status(fetcher: ServiceProcess, connection_id: str) -> dict[str, Any]:
    """The connection's latest sync once it is no longer queued or syncing."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status: dict[str, Any] = httpx.get(f"{fetcher.url}/v1/connections/{connection_id}/status", timeout=10).json()
        if status["status"] not in (None, "Queued", "Syncing"):
            return status
        time.sleep(0.2)
    raise TimeoutError(f"connection {connection_id} still syncing after 90 s")


def test_the_fetcher_serves_the_control_plane(services: dict[str, ServiceProcess], tmp_path: Path) -> None:
    """A folder connection made, synced, edited and deleted through the fetcher's API, as in ragstream up."""
    fetcher, retriever = services["connector-fetcher"], services["retriever"]
    paths = set(httpx.get(f"{fetcher.url}/openapi.json", timeout=10).json()["paths"])
    assert {"/v1/connections", "/v1/connections/{connection_id}/sync", "/v1/reindex", "/v1/replays"} <= paths
    assert "/v1/search" not in paths  # search is the retriever's
    folder = tmp_path / "control"
    folder.mkdir()
    (folder / "gamma.md").write_text("# Gamma\n\nThe quuxifier is serviced on Thursdays.\n")

    created = httpx.post(
        f"{fetcher.url}/v1/connections",
        json={"platform": "folder", "name": "control", "config": {"path": str(folder)}},
        timeout=10,
    )
    assert created.status_code == 201, created.text
    connection_id = created.json()["id"]

    def searched(term: str) -> list[str]:
        response = httpx.post(
            f"{retriever.url}/v1/search",
            json={"query": term, "filters": {"connection_ids": [connection_id]}},
            timeout=30,
        )
        response.raise_for_status()
        return [str(result["source"]) for result in response.json()["results"] if term in str(result["text"])]

    # Created with RAG on: synced in full at once, claimed and run by the fetcher over Kafka.
    status = connection_status(fetcher, connection_id)
    assert status["status"] == "Ready", status
    progress = status["progress"]
    assert (progress["trigger"], progress["listed"], progress["changed"], progress["indexed"]) == ("create", 1, 1, 1)
    assert progress["chunks"] >= 1 and progress["listing_done"]
    assert searched("quuxifier") == ["gamma.md"]

    (folder / "gamma.md").write_text("# Gamma\n\nThe quuxifier moved to Fridays.\n")
    started = httpx.post(f"{fetcher.url}/v1/connections/{connection_id}/sync", timeout=10)
    assert started.status_code == 202, started.text
    status = connection_status(fetcher, connection_id)
    assert (status["status"], status["progress"]["indexed"]) == ("Ready", 1), status
    assert searched("Fridays") == ["gamma.md"] and searched("Thursdays") == []
    runs = httpx.get(f"{fetcher.url}/v1/connections/{connection_id}/syncs", timeout=10).json()
    assert [(run["trigger"], run["status"]) for run in runs] == [("api", "Ready"), ("create", "Ready")]

    renamed = httpx.patch(f"{fetcher.url}/v1/connections/{connection_id}", json={"name": "renamed"}, timeout=10)
    assert renamed.status_code == 200 and renamed.json()["name"] == "renamed", renamed.text
    assert httpx.delete(f"{fetcher.url}/v1/connections/{connection_id}", timeout=10).status_code == 204
    assert httpx.get(f"{fetcher.url}/v1/connections/{connection_id}", timeout=10).status_code == 404
    assert searched("Fridays") == []


async def committed_state(database_url: str, folder: Path) -> tuple[set[str], list[tuple[str, int]], int]:
    """Indexed sources, (source, ordinal) of every chunk, and the sum of per-document chunk counts."""
    connection = await asyncpg.connect(database_url)
    try:
        where = "d.connection_id = $1 AND d.status = 'indexed'"
        connection_id = FolderConnector(folder).connection_id
        sources = {
            r["source"] for r in await connection.fetch(f"SELECT source FROM documents d WHERE {where}", connection_id)
        }
        chunks = await connection.fetch(
            f"SELECT d.source, c.ordinal FROM chunks c JOIN documents d ON d.id = c.document_id WHERE {where}",
            connection_id,
        )
        expected = await connection.fetchval(
            f"SELECT coalesce(sum(chunk_count), 0) FROM documents d WHERE {where}", connection_id
        )
        return sources, sorted((r["source"], r["ordinal"]) for r in chunks), int(expected)
    finally:
        await connection.close()


@pytest.mark.parametrize(
    ("stage", "point"),
    [
        ("chunker", "chunker.after_publish"),
        ("embedder", "embedder.after_publish"),
        ("indexer", "indexer.before_publish"),
    ],
)
async def test_crash_between_output_and_offset_commit_loses_nothing(
    services: dict[str, ServiceProcess],
    service_env: dict[str, str],
    database_url: str,
    tmp_path: Path,
    stage: str,
    point: str,
) -> None:
    folder = tmp_path / "crash"
    folder.mkdir()
    count = 12
    for number in range(count):
        body = f"Document {number} mentions crashterm{number}. " + "Filler sentence for a second chunk. " * 60
        (folder / f"doc{number:02}.md").write_text(f"# Doc {number}\n\n{body}\n")

    services[stage].stop()
    crashing = ServiceProcess(
        stage, {**service_env, "RAGSTREAM_CRASH_AT": point, "RAGSTREAM_CRASH_AFTER": "3"}, tmp_path
    )
    crashing.start(timeout=120)
    # Not waiting: the sync cannot be ready before the crashed stage is back.
    trigger_sync(services["connector-fetcher"], folder, wait=False)
    assert crashing.wait_exit(timeout=120) == 86, crashing.tail()
    services[stage] = ServiceProcess(stage, service_env, tmp_path).start(timeout=120)

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        sources, chunks, expected = await committed_state(database_url, folder)
        if len(sources) == count:
            break
        await asyncio.sleep(0.5)
    assert sources == {f"doc{number:02}.md" for number in range(count)}
    assert len(chunks) == len(set(chunks)) == expected
    assert all(found(services["retriever"], folder, f"crashterm{n}") == [f"doc{n:02}.md"] for n in (0, count - 1))


async def failed_and_indexed(database_url: str, folder: Path) -> tuple[set[str], set[str]]:
    """Sources with a failure row, and sources indexed, of the folder's connection."""
    connection = await asyncpg.connect(database_url)
    try:
        connection_id = FolderConnector(folder).connection_id
        failed = await connection.fetch("SELECT source FROM document_failures WHERE connection_id = $1", connection_id)
        indexed = await connection.fetch(
            "SELECT source FROM documents WHERE connection_id = $1 AND status = 'indexed'", connection_id
        )
        return {r["source"] for r in failed}, {r["source"] for r in indexed}
    finally:
        await connection.close()


async def test_dead_letters_replayed_once_their_cause_is_fixed(
    services: dict[str, ServiceProcess],
    database_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    folder = tmp_path / "dead"
    folder.mkdir()
    sources = {f"letter{n}.md" for n in range(5)}
    for n in range(5):
        (folder / f"letter{n}.md").write_text(f"# Letter {n}\n\nThe deadletterterm{n} page.\n")

    # A broken chunking config on the connection: the chunker fails every document, each is
    # dead-lettered, and nothing of the connection is indexed.
    connection_id = FolderConnector(folder).connection_id
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute(
            # Synced on request only: the fetchers' scheduler must not take it first.
            "INSERT INTO connections (id, platform, name, config, schedule_seconds)"
            " VALUES ($1, 'folder', 'dead', $2::jsonb, 0)",
            connection_id,
            '{"chunking": {"kind": "no-such-chunker"}}',
        )
        trigger_sync(services["connector-fetcher"], folder)
        # Ready once every document was dead-lettered: the run and the connection say so.
        assert (await failed_and_indexed(database_url, folder)) == (sources, set())
        assert [run[1:] for run in await fetch_runs(database_url, folder)] == [("succeeded", 5, 5, 0, 0, 5, "backward")]
        assert await connection.fetchval("SELECT connection_sync_error($1)", connection_id) == (
            "5 documents failed: 5 ValueError"
        )
        await connection.execute("UPDATE connections SET config = config - 'chunking' WHERE id = $1", connection_id)
    finally:
        await connection.close()

    env = {**os.environ, "DATABASE_URL": database_url}
    command = [sys.executable, "-m", "ragstream.cli", "replay", "--kafka", kafka_bootstrap, "--dead-letter"]

    def replay() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    replayed = await asyncio.to_thread(replay)
    assert replayed.returncode == 0, replayed.stderr
    assert "replayed 5 (published)" in replayed.stderr

    deadline = time.monotonic() + 120
    while (state := await failed_and_indexed(database_url, folder)) != (set(), sources):
        assert time.monotonic() < deadline, f"replay did not index everything: {state}"
        await asyncio.sleep(0.5)
    _, chunks, expected = await committed_state(database_url, folder)
    assert len(chunks) == len(set(chunks)) == expected == 5
    assert found(services["retriever"], folder, "deadletterterm3") == ["letter3.md"]
    # The letters are still on the topic, but their documents are indexed now: nothing to re-drive.
    async with httpx.AsyncClient(timeout=60) as client:
        again = await client.post(
            f"{services['connector-fetcher'].url}/v1/replays",
            json={"source": "dead-letter", "connection_id": FolderConnector(folder).connection_id},
        )
    assert again.status_code == 200, again.text
    assert (again.json()["replayed"], again.json()["resolved"]) == (0, 5)
