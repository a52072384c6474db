"""Start the ragstream services as real processes, as a deployment would, and wait for readiness."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

from ragstream.distributed import SERVICE_APPS as MODULES

__all__ = ["MODULES", "ServiceProcess"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServiceProcess:
    """One service under uvicorn in its own process; ``kill()`` is a SIGKILL, a real crash."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.port = _free_port()
        self.env = {**os.environ, **env}
        # The services refuse to start without keys; these tests call them as the mesh would.
        if "RAGSTREAM_API_KEYS" not in self.env:
            self.env.setdefault("RAGSTREAM_AUTH", "none")
        # The retriever also serves gRPC: on a port of its own, never the default one another run may hold.
        self.grpc_port = _free_port()
        if name == "retriever":
            self.env.update(RAGSTREAM_GRPC_HOST="127.0.0.1", RAGSTREAM_GRPC_PORT=str(self.grpc_port))
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0, *, wait_ready: bool = True) -> Self:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    MODULES[self.name],
                    "--factory",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "warning",
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.tail()}")

    def wait_exit(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"
