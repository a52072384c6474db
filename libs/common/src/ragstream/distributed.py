"""``ragstream run-distributed`` (``make run-distributed``): Kafka, PostgreSQL and the five services as processes.

The distributed mode on one machine without Docker, wired like ``docker-compose.yml``: a KRaft
Apache Kafka node from the Maven Central jars (:mod:`ragstream.local_kafka`; ``KAFKA_BOOTSTRAP_SERVERS``
wins), the embedded PostgreSQL with pgvector (``DATABASE_URL`` wins), the migrations applied once,
then each service under uvicorn in a process of its own. The retriever serves search (HTTP and gRPC),
the connector-fetcher the control-plane API and the syncs of the given folders. SIGINT or SIGTERM stops
the services, then Kafka, then PostgreSQL; a service that dies stops the rest and fails the run.
Everything lives under ``$RAGSTREAM_DATA_DIR/distributed`` (logs in ``logs/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Annotated, Self

import httpx
from cryptography.fernet import Fernet
from pydantic import BaseModel, Field

from ragstream.local_kafka import KafkaNode
from ragstream.storage.database import apply_migrations
from ragstream.storage.embedded_postgres import EmbeddedPostgres

__all__ = ["SERVICE_APPS", "DistributedOptions", "DistributedRun", "Stopped", "run_distributed"]

# The uvicorn factory of each service (as in docker-compose.yml and the Dockerfile).
SERVICE_APPS = {
    "connector-fetcher": "ragstream_fetcher.main:create_app",
    "chunker": "ragstream_chunker.main:create_app",
    "embedder": "ragstream_embedder.main:create_app",
    "indexer": "ragstream_indexer.main:create_app",
    "retriever": "ragstream_retriever.main:create_app",
}
# What each service is for, in the listing printed once everything is ready.
_ROLES = {
    "connector-fetcher": "control plane: /v1/connections, syncs, status, re-index, re-chunk, replay",
    "chunker": "doc.changed -> doc.chunked (health, metrics)",
    "embedder": "doc.chunked -> chunk.embedded (health, metrics)",
    "indexer": "chunk.embedded -> PostgreSQL -> indexed (health, metrics)",
    "retriever": "search: POST /v1/search",
}
# A service answers SIGTERM by draining its work; then it is killed.
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Stopped(Exception):
    """SIGTERM arrived: unwind and stop everything, like Ctrl-C."""


class DistributedOptions(BaseModel):
    """Where the launcher serves and what it syncs."""

    host: Annotated[str, Field(title="Interface every service binds")] = "127.0.0.1"
    port: Annotated[int, Field(title="Search API port (retriever)", ge=1, le=65535)] = 8080
    control_port: Annotated[int, Field(title="Control-plane API port (connector-fetcher)", ge=1, le=65535)] = 8081
    grpc_port: Annotated[int, Field(title="Retriever gRPC port; 0 disables gRPC", ge=0, le=65535)] = 50051
    sources: Annotated[list[Path], Field(title="Folders the fetcher syncs at start and on its timer")] = []
    sync_interval_s: Annotated[float, Field(title="Seconds between timed syncs of the sources", gt=0)] = 3600
    data_dir: Annotated[Path, Field(title="Root of the Kafka log, the PostgreSQL cluster and the logs")]
    ready_timeout_s: Annotated[float, Field(title="Seconds each service may take to become ready", gt=0)] = 180


class _ServiceProcess:
    """One service under uvicorn in its own session, so a terminal's Ctrl-C reaches only the launcher,
    which stops the services in order."""

    def __init__(self, name: str, host: str, port: int, env: dict[str, str], log_dir: Path) -> None:
        self.name, self.host, self.port, self.env = name, host, port, env
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Self:
        command = [sys.executable, "-m", "uvicorn", SERVICE_APPS[self.name], "--factory"]
        command += ["--host", self.host, "--port", str(self.port), "--log-level", "warning"]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_stop_with_parent(os.getpid()),
            )
        return self

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class DistributedRun:
    """Start, list, supervise and stop the whole distributed deployment; a context manager."""

    def __init__(self, options: DistributedOptions, environ: dict[str, str] | None = None) -> None:
        self.options = options
        self.environ = dict(os.environ if environ is None else environ)
        self.root = options.data_dir.resolve() / "distributed"
        self.log_dir = self.root / "logs"
        self.services: list[_ServiceProcess] = []
        self.database_url = ""
        self.kafka_bootstrap = ""
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        # Refusals first, before a broker or a database is started for nothing.
        open_access = self._check_access()
        ports = self._ports()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.database_url = self.environ.get("DATABASE_URL") or self._start_postgres()
        # Once, before any service: five services must not all wait on the migration lock.
        asyncio.run(apply_migrations(self.database_url))
        self.kafka_bootstrap = self.environ.get("KAFKA_BOOTSTRAP_SERVERS") or self._start_kafka()
        env = self._service_env(open_access)
        self._stack.callback(self._stop_services)
        for name in SERVICE_APPS:
            self.services.append(_ServiceProcess(name, self.options.host, ports[name], env, self.log_dir).start())
        self._wait_ready()

    def _start_postgres(self) -> str:
        server = EmbeddedPostgres(self.root / "postgres")
        dsn = server.start()
        self._stack.callback(server.stop)
        return dsn

    def _start_kafka(self) -> str:
        node = KafkaNode(self.root / "kafka")
        bootstrap = node.start()
        self._stack.callback(node.stop)
        return bootstrap

    def _check_access(self) -> bool:
        """Whether the services run without keys: as ``ragstream up``, only on loopback."""
        if "RAGSTREAM_API_KEYS" in self.environ:
            return False
        if not _is_loopback(self.options.host):
            raise SystemExit(f"--host {self.options.host} serves the network: set RAGSTREAM_API_KEYS first")
        return True

    def _service_env(self, open_access: bool) -> dict[str, str]:
        options = self.options
        env = self.environ | {
            "DATABASE_URL": self.database_url,
            "KAFKA_BOOTSTRAP_SERVERS": self.kafka_bootstrap,
            "RAGSTREAM_GRPC_HOST": options.host,
            "RAGSTREAM_GRPC_PORT": str(options.grpc_port),
            "RAGSTREAM_FETCHER_FOLDERS": json.dumps([str(source.resolve()) for source in options.sources]),
            "RAGSTREAM_FETCHER_INTERVAL_S": str(options.sync_interval_s),
        }
        if "RAGSTREAM_CREDENTIAL_KEYS" not in env:
            env["RAGSTREAM_CREDENTIAL_KEYS"] = self._credential_key()
        if open_access:
            env["RAGSTREAM_AUTH"] = "none"
        return env

    def _credential_key(self) -> str:
        """A Fernet key kept beside the data (mode 0600), so credentials stored in one run decrypt in
        the next; ``RAGSTREAM_CREDENTIAL_KEYS`` replaces it."""
        path = self.root / "credential.key"
        if not path.exists():
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as key_file:
                key_file.write(Fernet.generate_key().decode())
        return path.read_text().strip()

    def _ports(self) -> dict[str, int]:
        options = self.options
        fixed = {"retriever": options.port, "connector-fetcher": options.control_port}
        wanted = [*fixed.items(), *([("retriever's gRPC", options.grpc_port)] if options.grpc_port else [])]
        if len({port for _, port in wanted}) < len(wanted):
            raise SystemExit(f"the search, control and gRPC ports must differ: {dict(wanted)}")
        for name, port in wanted:
            if not _port_free(options.host, port):
                raise SystemExit(f"{options.host}:{port} (for the {name}) is already in use")
        stages = [name for name in SERVICE_APPS if name not in fixed]
        return fixed | dict(zip(stages, _free_ports(options.host, len(stages)), strict=True))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.ready_timeout_s
        waiting = list(self.services)
        while waiting:
            self.check_alive()
            waiting = [service for service in waiting if not service.ready()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(service.name for service in waiting)
                raise RuntimeError(f"not ready after {self.options.ready_timeout_s:.0f} s: {names}")
            if waiting:
                time.sleep(_POLL_S)

    def check_alive(self) -> None:
        """Raise, with the end of its log, when a service has exited."""
        for service in self.services:
            if (code := service.exited()) is not None:
                raise RuntimeError(f"the {service.name} exited with {code}:\n{service.tail()}")

    def _stop_services(self) -> None:
        for service in self.services:
            service.terminate()
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for service in self.services:
            service.wait_or_kill(deadline)

    def listing(self) -> str:
        """Where each part listens, for the console."""
        by_name = {service.name: service for service in self.services}
        grpc = f", gRPC {self.options.host}:{self.options.grpc_port}" if self.options.grpc_port else ""
        lines = [f"  {'retriever':<18} {by_name['retriever'].url}{grpc}  {_ROLES['retriever']}"]
        lines += [f"  {name:<18} {by_name[name].url}  {_ROLES[name]}" for name in SERVICE_APPS if name != "retriever"]
        kafka_origin = "given" if self.environ.get("KAFKA_BOOTSTRAP_SERVERS") else "local KRaft node"
        postgres_origin = "DATABASE_URL" if self.environ.get("DATABASE_URL") else f"embedded, {self.root / 'postgres'}"
        lines.append(f"  {'kafka':<18} {self.kafka_bootstrap}  ({kafka_origin})")
        lines.append(f"  {'postgresql':<18} {_without_password(self.database_url)}  ({postgres_origin})")
        lines.append(f"  {'logs':<18} {self.log_dir}")
        return "\n".join(lines)


def run_distributed(options: DistributedOptions) -> int:
    """Serve until SIGINT or SIGTERM (0) or until a service dies (1)."""
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        with DistributedRun(options) as run:
            print("ragstream distributed mode is ready:", flush=True)
            print(run.listing(), flush=True)
            synced = ", ".join(str(source) for source in options.sources) or "nothing (create connections)"
            print(f"syncing {synced}; Ctrl-C stops everything.", flush=True)
            while True:
                run.check_alive()
                time.sleep(_POLL_S)
    except (KeyboardInterrupt, Stopped):
        print("ragstream distributed mode stopped.", flush=True)
        return 0
    except RuntimeError as error:
        print(f"ragstream distributed mode failed: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_with_parent(parent: int) -> Callable[[], None] | None:
    """For a child, before it runs: SIGTERM when the launcher dies, even killed by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so a service never outlives it holding its port."""
    if not sys.platform.startswith("linux"):
        return None

    def arrange() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arrange


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


def _is_loopback(host: str) -> bool:
    return host in {"127.0.0.1", "::1", "localhost"}


def _without_password(dsn: str) -> str:
    scheme, _, rest = dsn.partition("://")
    credentials, at, location = rest.rpartition("@")
    return f"{scheme}://{credentials.split(':', 1)[0]}@{location}" if at else dsn


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _free_ports(host: str, count: int) -> list[int]:
    """Distinct free ports: all sockets stay bound until every port is chosen."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
