"""``ragstream run-distributed`` (``make run-distributed``) end to end, as a user runs it: one subprocess that
starts its own Kafka, PostgreSQL and five services; a folder connection made over the control-plane API is
synced, searched through the retriever, edited and deleted; SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.integration]

# Kafka start, migrations, five services warming the local embedder on two shared cores.
_READY_TIMEOUT_S = 300.0
_SYNC_TIMEOUT_S = 180.0
# Every process the launcher starts inherits this variable: /proc/PID/environ finds them all.
_MARK = "RAGSTREAM_TEST_RUN_MARK"


@dataclass
class Launched:
    process: subprocess.Popen[str]
    search_url: str
    control_url: str
    mark: str
    output: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment carries ``mark`` (the launcher's children, Kafka, PostgreSQL)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if f"{_MARK}={mark}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_until(condition: Callable[[], bool], timeout: float, what: str, launched: Launched) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launched.process.poll() is not None:
            raise AssertionError(f"the launcher exited with {launched.process.returncode}:\n{launched.text()}")
        if condition():
            return
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}:\n{launched.text()[-3000:]}")


@pytest.fixture
def folders() -> Iterator[Path]:
    """Reachable by the unprivileged account the embedded PostgreSQL runs as (not pytest's 0700 tmp_path)."""
    root = Path(tempfile.mkdtemp(prefix="ragstream-run-distributed-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def launched(folders: Path) -> Iterator[Launched]:
    notes, sources = folders / "notes", folders / "sources"
    notes.mkdir()
    sources.mkdir()
    (sources / "welcome.md").write_text("# Welcome\n\nThe heliotrope onboarding checklist lives here.\n")
    mark = uuid.uuid4().hex
    search_port, control_port = _free_port(), _free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        # The launcher must start its own broker and database, as on a user's machine.
        if key not in {"DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS", "RAGSTREAM_API_KEYS"}
    }
    env |= {
        _MARK: mark,
        "RAGSTREAM_DATA_DIR": str(folders / "data"),
        "PORT": str(search_port),
        "CONTROL_PORT": str(control_port),
        "RAGSTREAM_GRPC_PORT": "0",
        "RAGSTREAM_FOLDER_ROOTS": str(notes),
        "RAGSTREAM_SYNC_PROGRESS_INTERVAL_S": "0.5",
    }
    output = folders / "launcher.log"
    with output.open("w") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("ragstream")), "run-distributed", "--source", str(sources)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    running = Launched(process, f"http://127.0.0.1:{search_port}", f"http://127.0.0.1:{control_port}", mark, output)
    try:
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in marked_processes(mark):  # a failed test must not leave a broker or a database running
            os.kill(pid, signal.SIGKILL)


def search(launched: Launched, query: str, connection_id: str | None = None) -> list[dict[str, Any]]:
    filters = {"connection_ids": [connection_id]} if connection_id else {}
    response = httpx.post(f"{launched.search_url}/v1/search", json={"query": query, "filters": filters}, timeout=30)
    response.raise_for_status()
    results: list[dict[str, Any]] = response.json()["results"]
    return results


def sources_found(launched: Launched, term: str, connection_id: str | None = None) -> set[str]:
    return {str(result["source"]) for result in search(launched, term, connection_id) if term in result["text"]}


def synced_after(launched: Launched, connection_id: str, previous_run: int) -> Callable[[], bool]:
    """Whether a run newer than ``previous_run`` ended Ready (a Failed one fails the test)."""

    def check() -> bool:
        response = httpx.get(f"{launched.control_url}/v1/connections/{connection_id}/status", timeout=10)
        response.raise_for_status()
        status = response.json()
        progress = status["progress"]
        if progress is None or progress["id"] <= previous_run:
            return False
        assert status["status"] != "Failed", status
        return bool(status["status"] == "Ready")

    return check


def latest_run(launched: Launched, connection_id: str) -> int:
    response = httpx.get(f"{launched.control_url}/v1/connections/{connection_id}/status", timeout=10)
    response.raise_for_status()
    return int(response.json()["progress"]["id"])


def sync(launched: Launched, connection_id: str) -> None:
    previous = latest_run(launched, connection_id)
    response = httpx.post(f"{launched.control_url}/v1/connections/{connection_id}/sync", timeout=10)
    assert response.status_code == 202, response.text
    wait_until(synced_after(launched, connection_id, previous), _SYNC_TIMEOUT_S, "the sync", launched)


def test_a_folder_connection_syncs_edits_and_deletes_then_sigterm_stops_everything(
    launched: Launched, folders: Path
) -> None:
    def ready() -> bool:
        return "Ctrl-C stops everything" in launched.text()

    wait_until(ready, _READY_TIMEOUT_S, "the launcher to report ready", launched)
    listing = launched.text()
    for part in ("retriever", "connector-fetcher", "chunker", "embedder", "indexer", "kafka", "postgresql"):
        assert part in listing, listing
    assert launched.search_url in listing and launched.control_url in listing

    # The folder given with --source is synced by the fetcher on its own.
    wait_until(
        lambda: sources_found(launched, "heliotrope") == {"welcome.md"}, _SYNC_TIMEOUT_S, "the source sync", launched
    )

    notes = folders / "notes"
    (notes / "vpn.md").write_text("# VPN\n\nConnect with the marigold profile before reaching staging.\n")
    (notes / "leave.md").write_text("# Leave\n\nAsk your lead; the amaranth form records every request.\n")
    created = httpx.post(
        f"{launched.control_url}/v1/connections",
        json={"platform": "folder", "name": "notes", "config": {"path": str(notes)}, "schedule_seconds": 0},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    connection_id = created.json()["id"]
    # Creating a connection with RAG on starts its first, full sync.
    wait_until(synced_after(launched, connection_id, 0), _SYNC_TIMEOUT_S, "the first sync", launched)
    assert sources_found(launched, "marigold", connection_id) == {"vpn.md"}
    assert sources_found(launched, "amaranth", connection_id) == {"leave.md"}

    (notes / "vpn.md").write_text("# VPN\n\nConnect with the cornflower profile before reaching staging.\n")
    sync(launched, connection_id)
    assert sources_found(launched, "cornflower", connection_id) == {"vpn.md"}
    assert sources_found(launched, "marigold", connection_id) == set()

    (notes / "leave.md").unlink()
    sync(launched, connection_id)
    assert sources_found(launched, "amaranth", connection_id) == set()
    assert sources_found(launched, "cornflower", connection_id) == {"vpn.md"}

    started = marked_processes(launched.mark)
    assert len(started) >= 7, started  # five services, the Kafka JVM, the PostgreSQL server and its workers
    launched.process.send_signal(signal.SIGTERM)
    assert launched.process.wait(timeout=120) == 0, launched.text()
    assert "stopped" in launched.text()
    assert marked_processes(launched.mark) == []


def run_refused(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "RAGSTREAM_API_KEYS"}
    env["RAGSTREAM_DATA_DIR"] = str(tmp_path)
    command = [str(Path(sys.executable).with_name("ragstream")), "run-distributed", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = run_refused(tmp_path, "--port", str(port), "--control-port", str(_free_port()))
    assert refused.returncode != 0
    assert f"127.0.0.1:{port} (for the retriever) is already in use" in refused.stderr
    assert not (tmp_path / "distributed").exists()  # no broker, no database, no logs


def test_serving_the_network_without_api_keys_is_refused(tmp_path: Path) -> None:
    refused = run_refused(tmp_path, "--host", "0.0.0.0", "--port", str(_free_port()))
    assert refused.returncode != 0
    assert "set RAGSTREAM_API_KEYS" in refused.stderr
    assert not (tmp_path / "distributed").exists()


@pytest.mark.kafka
def test_services_stop_when_the_launcher_is_killed(database_url: str, kafka_bootstrap: str, folders: Path) -> None:
    """SIGKILL gives the launcher no chance to stop anything: each service still stops (its parent-death
    signal), so none is left holding the search or control port. Kafka and PostgreSQL are given here."""
    mark = uuid.uuid4().hex
    search_port, control_port = _free_port(), _free_port()
    env = {key: value for key, value in os.environ.items() if key != "RAGSTREAM_API_KEYS"}
    env |= {
        _MARK: mark,
        "DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RAGSTREAM_DATA_DIR": str(folders / "data"),
        "RAGSTREAM_GRPC_PORT": "0",
    }
    command = [str(Path(sys.executable).with_name("ragstream")), "run-distributed"]
    command += ["--port", str(search_port), "--control-port", str(control_port)]
    output = folders / "launcher.log"
    with output.open("w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    launched = Launched(process, f"http://127.0.0.1:{search_port}", f"http://127.0.0.1:{control_port}", mark, output)
    try:
        wait_until(lambda: "Ctrl-C stops everything" in launched.text(), _READY_TIMEOUT_S, "ready", launched)
        assert len(marked_processes(mark)) == 6  # the launcher and five services
        process.kill()
        process.wait(10)
        deadline = time.monotonic() + 60
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marked_processes(mark) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)


def test_the_same_port_for_two_apis_is_refused(tmp_path: Path) -> None:
    port = str(_free_port())
    refused = run_refused(tmp_path, "--port", port, "--control-port", port)
    assert refused.returncode != 0
    assert "must differ" in refused.stderr
    assert not (tmp_path / "distributed").exists()
