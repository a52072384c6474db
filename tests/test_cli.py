"""The ``ragstream`` command as a user runs it: ingest with progress and exit codes, search, up."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.support.grpc_client import result_dict

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
RAGSTREAM = [sys.executable, "-m", "ragstream.cli"]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RAGSTREAM, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


# What a folder sync in a fresh process must not import: each costs a share of a second of every
# `ragstream ingest`, and only other commands (up, replay --kafka), actual chunking or stored
# credentials need them.
_NOT_FOR_A_FOLDER_SYNC = ("fastapi", "faststream", "langchain_text_splitters", "cryptography")


def test_the_command_imports_no_web_framework_kafka_client_or_langchain() -> None:
    probe = f"import sys, ragstream.cli; print(sorted(set({_NOT_FOR_A_FOLDER_SYNC!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_ingest_reports_progress_and_failures_then_search(database_url: str, corpus: Path, tmp_path: Path) -> None:
    env = {"DATABASE_URL": database_url, "COLUMNS": "160"}
    # Words no other test indexes: the CLI searches every connection of the shared test database.
    (corpus / "runbook.md").write_text("# Runbook\n\n## Paging\n\nThe quillwhistle pager hands over on Tuesdays.\n")
    (corpus / "制度.md").write_text("# 差旅制度\n\n蜂鸟报销单需在费用发生后三十天内提交。\n")

    first = run(["ingest", str(corpus)], env)
    assert first.returncode == 0, first.stderr
    assert "2/2" in first.stderr and "docs/s" in first.stderr and "ETA" in first.stderr
    assert "2 indexed" in first.stderr

    (corpus / "broken.md").write_bytes(b"\xff\xfe\x00\x00binary")
    second = run(["ingest", str(corpus)], env)
    assert second.returncode == 1
    assert "2 unchanged" in second.stderr and "broken.md" in second.stderr and "binary" in second.stderr

    status = run(["status", "--json", "--database-url", database_url], {"COLUMNS": "160"})
    assert status.returncode == 0, status.stderr
    mine = next(
        row for row in json.loads(status.stdout) if row["connection_id"] == FolderConnector(corpus).connection_id
    )
    # The sync itself completed; the last error summarises the document that did not index.
    assert (mine["status"], mine["trigger"], mine["platform"], mine["last_error"]) == (
        "Ready",
        "cli",
        "folder",
        "1 document failed: 1 binary",
    )
    assert (mine["listed"], mine["unchanged"], mine["indexed"], mine["failed"]) == (3, 2, 0, 1)
    assert mine["listing_done"] and mine["finished_at"] is not None
    # The first ingest walked everything (backward); this second one only what changed.
    assert (mine["direction"], mine["resumed"]) == ("forward", False)
    table = run(["status"], env)
    assert table.returncode == 0 and "Ready" in table.stdout and "1 document failed: 1 binary" in table.stdout

    found = run(["search", "quillwhistle pager handover", "--json", "--top-k", "3"], env)
    assert found.returncode == 0, found.stderr
    top = json.loads(found.stdout)["results"][0]
    assert (top["source"], top["rank"], top["citation_index"]) == ("runbook.md", 1, 1)

    queries = tmp_path / "queries.jsonl"
    queries.write_text('{"id": "en", "query": "quillwhistle pager"}\n\n{"id": "zh", "query": "蜂鸟报销单 提交"}\n')
    batch = run(["search", "--batch", str(queries), "--json", "--top-k", "1"], env)
    assert batch.returncode == 0, batch.stderr
    lines = [json.loads(line) for line in batch.stdout.splitlines()]
    assert [(line["id"], line["results"][0]["source"]) for line in lines] == [("en", "runbook.md"), ("zh", "制度.md")]

    assert run(["search"], env).returncode != 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under /tmp, not pytest's tmp_path: as root the embedded server runs as an unprivileged user.
    folder = Path(tempfile.mkdtemp(prefix="ragstream-up-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_up_serves_the_sample_knowledge_base_from_an_embedded_postgres(data_dir: Path) -> None:
    port, grpc_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    env["RAGSTREAM_DATA_DIR"] = str(data_dir)
    env["RAGSTREAM_FOLDER_ROOTS"] = str(data_dir)  # where the connection made over the API lives
    process = subprocess.Popen(
        [
            *RAGSTREAM,
            "up",
            str(REPO / "examples" / "knowledge-base"),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        sources: list[str] = []
        results: list[dict[str, object]] = []
        while time.monotonic() < deadline and process.poll() is None:
            try:
                progress = httpx.get(f"{base}/v1/syncs", timeout=5).json()
                if progress and all(p["listing_done"] and p["done"] == p["listed"] for p in progress.values()):
                    response = httpx.post(f"{base}/v1/search", json={"query": "出差住宿标准是多少？"}, timeout=30)
                    results = response.json()["results"]
                    sources = [result["source"] for result in results]
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert sources and sources[0] == "zh/chailv-biaozhun.md"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = retrieval_pb2.SearchRequest(query="出差住宿标准是多少？")
            answer = retrieval_pb2_grpc.RetrievalStub(channel).Search(request, timeout=30)
        assert [result_dict(result) for result in answer.results] == results
        replayed = httpx.post(f"{base}/v1/replays", json={}, timeout=30)
        assert replayed.status_code == 200 and replayed.json()["replayed"] == 0, replayed.text
        assert httpx.post(f"{base}/v1/replays", json={"source": "dead-letter"}, timeout=30).status_code == 422
        connection = FolderConnector(REPO / "examples" / "knowledge-base").connection_id
        # The run ends just after its last document is indexed: it may still be finishing.
        while time.monotonic() < deadline:
            status = httpx.get(f"{base}/v1/connections/{connection}/status", timeout=5).json()
            if status["status"] != "Syncing":
                break
            time.sleep(0.2)
        assert (status["status"], status["progress"]["trigger"]) == ("Ready", "cli"), status
        assert status["progress"]["indexed"] == status["progress"]["listed"] > 0

        # A connection created over the API starts its first full sync by itself.
        notes = data_dir / "notes"
        notes.mkdir()
        notes.chmod(0o755)
        (notes / "kite.md").write_text("# Kites\n\nThe zephyrkite flies at dawn.\n")
        created = httpx.post(
            f"{base}/v1/connections",
            json={"platform": "folder", "name": "notes", "config": {"path": str(notes)}},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        while time.monotonic() < deadline:
            status = httpx.get(f"{base}/v1/connections/{created.json()['id']}/status", timeout=5).json()
            if status["status"] in ("Ready", "Failed"):
                break
            time.sleep(0.2)
        assert (status["status"], status["progress"]["trigger"], status["progress"]["indexed"]) == (
            "Ready",
            "create",
            1,
        ), status
        assert (data_dir / "postgres" / "PG_VERSION").exists()
    finally:
        process.terminate()
        process.wait(30)
