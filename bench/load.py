"""Load probe of the search API: concurrency levels, latency, status counts, recovery and shutdown.

    python -m bench.load [--url http://127.0.0.1:8080] [--levels 1,8,64,500] [--durations 10,20,60,30]

Without ``--url`` it starts ``ragstream up`` itself on 127.0.0.1, on a fresh data folder under /tmp
with ``examples/knowledge-base``, waits for the sync, and at the end stops it with SIGTERM and times
the exit. Each level runs that many callers, each sending ``POST /v1/search`` back to back for the
level's duration (a caller's request in flight at the end is still counted). A clean answer under
overload is 200, or 503 with ``Retry-After``; anything else (another status, a 503 without
Retry-After, a timeout, a refused connection) is "other". After the last level a few sequential
searches and ``/readyz`` must succeed (recovery). Loopback only; bounded by the durations, the
per-request timeout and the shutdown wait.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
KNOWLEDGE_BASE = REPO / "examples" / "knowledge-base"
QUERIES = (
    "How do I restore a PostgreSQL backup?",
    "kafka consumer lag runbook",
    "two-factor authentication password rules",
    "how many days of annual leave",
    "API pagination and idempotency keys",
    "travel expense hotel limit",
    "数据库备份怎么恢复",
    "请假制度 年假",
)
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass
class Level:
    """What one concurrency level measured."""

    callers: int
    duration_s: float
    load_before: float
    load_after: float = 0.0
    elapsed_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    ok: int = 0
    refused: int = 0  # 503 with Retry-After
    other: int = 0
    others: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.ok + self.refused + self.other

    def percentile(self, share: float) -> float:
        """Nearest-rank percentile of every request's latency, in milliseconds."""
        ordered = sorted(self.latencies_s)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))] * 1000

    def record(self, outcome: str, latency_s: float) -> None:
        self.latencies_s.append(latency_s)
        if outcome == "200":
            self.ok += 1
        elif outcome == "503+Retry-After":
            self.refused += 1
        else:
            self.other += 1
            self.others[outcome] = self.others.get(outcome, 0) + 1


async def _one(client: httpx.AsyncClient, query: str) -> str:
    try:
        response = await client.post("/v1/search", json={"query": query, "top_k": 5})
    except httpx.HTTPError as error:
        return type(error).__name__
    if response.status_code == 503 and response.headers.get("retry-after"):
        return "503+Retry-After"
    return str(response.status_code)


async def run_level(url: str, callers: int, duration_s: float, timeout_s: float) -> Level:
    level = Level(callers, duration_s, os.getloadavg()[0])
    # Each caller has a client of one keep-alive connection: one httpx pool of hundreds of
    # connections spends more CPU per request the more it holds (about 100 requests/s in all at 64
    # against a server answering 2,000), so the client would be what is measured. One TLS context
    # for all: httpx builds one per client otherwise, even for plain http.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()
    clients = [httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s, verify=tls) for _ in range(callers)]
    started = time.monotonic()
    stop = started + duration_s

    async def caller(index: int) -> None:
        sent = index
        while time.monotonic() < stop:
            began = time.monotonic()
            outcome = await _one(clients[index], QUERIES[sent % len(QUERIES)])
            level.record(outcome, time.monotonic() - began)
            sent += 1

    try:
        await asyncio.gather(*(caller(index) for index in range(callers)))
        level.elapsed_s = time.monotonic() - started
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))
    level.load_after = os.getloadavg()[0]
    return level


async def recovery(url: str, searches: int, timeout_s: float) -> list[str]:
    """Outcomes of ``searches`` sequential searches and then ``/readyz``, right after the storm."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        outcomes = [await _one(client, QUERIES[index % len(QUERIES)]) for index in range(searches)]
        try:
            outcomes.append(f"readyz {(await client.get('/readyz')).status_code}")
        except httpx.HTTPError as error:
            outcomes.append(f"readyz {type(error).__name__}")
    return outcomes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path


@contextmanager
def ragstream_up(startup_timeout_s: float) -> Iterator[Server]:
    """``ragstream up examples/knowledge-base`` on 127.0.0.1 with a fresh data folder (removed at
    the end), once its first sync indexed documents; killed if still running on exit."""
    data_dir = Path(tempfile.mkdtemp(prefix="ragstream-load-"))
    port = _free_port()
    log = data_dir / "server.log"
    env = {**os.environ, "RAGSTREAM_DATA_DIR": str(data_dir / "data"), "RAGSTREAM_SCHEDULER_ENABLED": "false"}
    command = [sys.executable, "-c", "from ragstream.cli import app; app()", "up", str(KNOWLEDGE_BASE)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", "--sync-interval", "0"]
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        _wait_indexed(server, startup_timeout_s)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        shutil.rmtree(data_dir, ignore_errors=True)


def _wait_indexed(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"ragstream up exited ({server.process.returncode}):\n{server.log.read_text()[-3000:]}")
        try:
            answer = httpx.post(f"{server.url}/v1/search", json={"query": QUERIES[0]}, timeout=10)
            syncs = httpx.get(f"{server.url}/v1/syncs", timeout=10).json().values()
            # Searched while the first sync still embeds, the levels would measure the ingest too.
            if answer.status_code == 200 and answer.json()["results"] and _finished(syncs):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"ragstream up did not index the knowledge base within {timeout_s} s")


def _finished(syncs: Iterable[dict[str, Any]]) -> bool:
    return all(sync["listing_done"] and sync["done"] >= sync["listed"] for sync in syncs)


def stop(server: Server, timeout_s: float) -> tuple[float, int | None]:
    """SIGTERM, then the seconds until the process exited and its exit code (None: still running)."""
    began = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code: int | None = server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    return time.monotonic() - began, code


def table(levels: list[Level]) -> str:
    rows = [
        "| callers | duration s | requests | req/s | p50 ms | p95 ms | p99 ms | error rate | 200 | 503 | other"
        " | load before → after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for level in levels:
        errors = (level.total - level.ok) / level.total if level.total else 0.0
        other = f"{level.other} {level.others}" if level.others else "0"
        rows.append(
            f"| {level.callers} | {level.elapsed_s:.1f} | {level.total} | {level.total / level.elapsed_s:.1f}"
            f" | {level.percentile(0.50):.0f} | {level.percentile(0.95):.0f} | {level.percentile(0.99):.0f}"
            f" | {errors:.1%} | {level.ok} | {level.refused} | {other}"
            f" | {level.load_before:.2f} → {level.load_after:.2f} |"
        )
    return "\n".join(rows)


async def probe(url: str, args: argparse.Namespace) -> tuple[list[Level], list[str]]:
    levels: list[Level] = []
    for callers, duration_s in zip(args.levels, args.durations, strict=True):
        print(f"level {callers} callers for {duration_s} s …", flush=True)
        levels.append(await run_level(url, callers, duration_s, args.timeout))
        await asyncio.sleep(args.pause)
    return levels, await recovery(url, args.recovery, args.timeout)


def _numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="A running server (loopback only); unset: start `ragstream up`.")
    parser.add_argument("--levels", type=_numbers, default=[1, 8, 64, 500], help="Callers per level.")
    parser.add_argument("--durations", type=_numbers, default=[10, 20, 60, 30], help="Seconds per level.")
    parser.add_argument("--timeout", type=float, default=60.0, help="Client timeout per request, seconds.")
    parser.add_argument("--pause", type=float, default=2.0, help="Seconds between levels.")
    parser.add_argument("--recovery", type=int, default=5, help="Sequential searches after the storm.")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--shutdown-timeout", type=float, default=60.0, help="Longest wait for exit on SIGTERM.")
    args = parser.parse_args(argv)
    if len(args.levels) != len(args.durations):
        parser.error("--levels and --durations need the same number of entries")
    if max(args.levels) > 1000 or max(args.durations) > 120:
        parser.error("at most 1000 callers and 120 s per level")
    if args.url and httpx.URL(args.url).host not in _LOOPBACK:
        parser.error("--url must be a loopback address")

    shutdown: tuple[float, int | None] | None = None
    if args.url:
        levels, recovered = asyncio.run(probe(args.url, args))
    else:
        with ragstream_up(args.startup_timeout) as server:
            levels, recovered = asyncio.run(probe(server.url, args))
            shutdown = stop(server, args.shutdown_timeout)

    print(f"\n{os.cpu_count()} CPUs; load average now {os.getloadavg()[0]:.2f}\n")
    print(table(levels))
    print(f"\nrecovery: {recovered}")
    if shutdown is not None:
        print(f"SIGTERM: exited after {shutdown[0]:.1f} s with code {shutdown[1]}")
    clean = all(level.other == 0 for level in levels)
    recovered_ok = all(outcome in ("200", "readyz 200") for outcome in recovered)
    stopped = shutdown is None or shutdown[1] is not None
    return 0 if clean and recovered_ok and stopped else 1


if __name__ == "__main__":
    sys.exit(main())
