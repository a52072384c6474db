"""DashScope at its concurrency ceiling: the embed stage's requests against the fake DashScope.

    .venv/bin/python -m bench.embed_ceiling [--latencies 50,200,1000] [--documents 300] [--workers 24]

For each per-request latency, ``--documents`` documents of 1 to 7 chunks (about 4 on average, the
same seeded set every run) go through ``EmbedService.run`` with ``--workers`` documents in flight, as
the embedded pipeline's workers (``RAGSTREAM_INGEST_WORKERS``) run them, against the project's fake
DashScope (``tests/support/fake_dashscope.py`` in a child process, real HTTP on 127.0.0.1; requests
counted by the transport below the outbound gate), through the real ``DashScopeEmbedder`` (its
limits and retries unchanged: 10 texts per request, 5 in flight), asking for 64-d vectors
by default (``--dimension``; 1,024, the production size, costs each side about 1 ms more a request).
The ceiling is ``5 × 10 / latency`` texts/s (250/s at 200 ms). Printed per latency: requests, texts
per request, the most requests in flight, texts/s and its share of the ceiling, then the same texts
as one ``embed`` call (every batch queued at once: what this machine's HTTP stack and CPU reach, the
practical ceiling here) and the stage's share of it, the CPU milliseconds per request of this process
and of the fake's (both on the same cores), and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.support is imported from the repository, not installed
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from ragstream.embedding.dashscope import DashScopeEmbedder  # noqa: E402
from ragstream.messages import ChunkPayload, DocumentChunked, DocumentHeader  # noqa: E402
from ragstream.stages.embed import EmbedService  # noqa: E402
from tests.support.fake_dashscope import DEFAULT_API_KEY, FakeDashScope, create_app  # noqa: E402
from tests.support.http_server import serve_in_thread  # noqa: E402

SEED = 20261202
# Words of database documentation, for made-up chunks of a realistic length.
WORDS = [
    "table",
    "index",
    "vacuum",
    "query",
    "planner",
    "replication",
    "backup",
    "restore",
    "role",
    "schema",
    "trigger",
    "partition",
    "transaction",
    "snapshot",
    "checkpoint",
    "cursor",
    "sequence",
    "constraint",
    "aggregate",
    "window",
    "extension",
    "tablespace",
]
IN_FLIGHT = 5
BATCH = 10


def documents(count: int) -> list[DocumentChunked]:
    """``count`` documents of 1 to 7 chunks of about 600 characters each."""
    rng = random.Random(SEED)
    made = []
    for number in range(count):
        chunks = [
            ChunkPayload(ordinal=i, heading=f"Section {i}", text=" ".join(rng.choices(WORDS[:11], k=90)))
            for i in range(rng.randint(1, 7))
        ]
        header = DocumentHeader(
            document_id=f"doc-{number}",
            connection_id="bench",
            external_id=f"page-{number}.html",
            version=1,
            content_hash="0" * 64,
            title=f"Page {number}",
            source=f"page-{number}.html",
            media_type="text/html",
        )
        made.append(
            DocumentChunked(
                header=header, batch_index=0, batch_count=1, chunk_count=len(chunks), chunks=chunks, index_version=1
            )
        )
    return made


class CountingTransport(httpx.AsyncBaseTransport):
    """The network below the outbound gate, counting each request's texts and the requests in flight."""

    def __init__(self) -> None:
        self._network = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
        )
        self.sizes: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sizes.append(len(json.loads(request.content)["input"]["texts"]))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = await self._network.handle_async_request(request)
            await response.aread()
            return response
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        await self._network.aclose()


class FakeProcess:
    """The fake DashScope delaying every request by ``delay_s``, served by a child process: its CPU
    (building and serialising vectors) does not share this process's GIL with the client's, though
    it shares the machine's cores. ``cpu_s()`` asks the child for the CPU seconds it has used."""

    def __init__(self, delay_s: float) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "bench.embed_ceiling", "--serve-fake", str(delay_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self._child.stdin is not None and self._child.stdout is not None
        self._stdin, self._stdout = self._child.stdin, self._child.stdout
        self.base_url = self._stdout.readline().strip()

    def cpu_s(self) -> float:
        self._stdin.write("cpu\n")
        self._stdin.flush()
        return float(self._stdout.readline())

    def close(self) -> None:
        self._stdin.close()
        self._child.wait(timeout=30)


@contextmanager
def fake_in_its_own_process(delay_s: float) -> Iterator[FakeProcess]:
    fake = FakeProcess(delay_s)
    try:
        yield fake
    finally:
        fake.close()


def serve_fake(delay_s: float) -> None:
    """In the child: serve, answering each line on stdin with the CPU seconds used so far, until the
    parent closes it."""
    with serve_in_thread(create_app(FakeDashScope(delay_s=delay_s)), "fake-dashscope") as base_url:
        print(base_url, flush=True)
        for _ in sys.stdin:
            print(time.process_time(), flush=True)


async def one_latency(
    base_url: str, messages: list[DocumentChunked], workers: int, dimension: int, transport: CountingTransport
) -> float:
    """Seconds to embed every message, ``workers`` at a time, through one embed stage."""
    embedder = DashScopeEmbedder(
        api_key=DEFAULT_API_KEY,
        base_url=base_url,
        max_concurrency=IN_FLIGHT,
        dimension=dimension,
        transport=transport,
    )
    service = EmbedService(embedder)
    queue: asyncio.Queue[DocumentChunked] = asyncio.Queue()
    for message in messages:
        queue.put_nowait(message)

    async def worker() -> None:
        while not queue.empty():
            await service.run(queue.get_nowait())

    try:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workers)))
        return time.perf_counter() - started
    finally:
        await embedder.aclose()


async def all_at_once(base_url: str, texts: list[str], dimension: int) -> float:
    """Seconds for one ``embed`` call with every text: all batches queued at once, no document
    boundaries, so only this machine's HTTP and CPU stand between it and the ceiling."""
    embedder = DashScopeEmbedder(
        api_key=DEFAULT_API_KEY, base_url=base_url, max_concurrency=IN_FLIGHT, dimension=dimension
    )
    try:
        started = time.perf_counter()
        await embedder.embed(texts)
        return time.perf_counter() - started
    finally:
        await embedder.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latencies", default="50,200,1000", help="milliseconds per request, comma-separated")
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--workers", type=int, default=24, help="documents in flight")
    parser.add_argument(
        "--dimension",
        type=int,
        default=64,
        help="vector size asked for (64..1024); the fake builds 1,024-d vectors in pure Python, ~18 ms a text",
    )
    parser.add_argument("--serve-fake", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake is not None:
        serve_fake(args.serve_fake)
        return
    # The fake listens on 127.0.0.1, which ragstream.outbound refuses unless told otherwise.
    os.environ["RAGSTREAM_ALLOW_PRIVATE_NETWORKS"] = "true"
    messages = documents(args.documents)
    texts = sum(len(message.chunks) for message in messages)
    rows: list[dict[str, Any]] = []
    flat = [chunk.text for message in messages for chunk in message.chunks]
    for latency_ms in (int(value) for value in args.latencies.split(",")):
        with fake_in_its_own_process(latency_ms / 1000) as fake:
            load_before = os.getloadavg()[0]
            transport = CountingTransport()
            client_cpu, fake_cpu = time.process_time(), fake.cpu_s()
            wall = asyncio.run(one_latency(fake.base_url, messages, args.workers, args.dimension, transport))
            client_cpu, fake_cpu = time.process_time() - client_cpu, fake.cpu_s() - fake_cpu
            direct = asyncio.run(all_at_once(fake.base_url, flat, args.dimension))
        sizes = transport.sizes
        ceiling = IN_FLIGHT * BATCH / (latency_ms / 1000)
        rows.append(
            {
                "latency_ms": latency_ms,
                "documents": len(messages),
                "texts": texts,
                "requests": len(sizes),
                "full_requests": sum(size == BATCH for size in sizes),
                "texts_per_request": round(sum(sizes) / len(sizes), 2),
                "max_in_flight_seen": transport.max_in_flight,
                "wall_s": round(wall, 2),
                "texts_per_s": round(texts / wall, 1),
                "ceiling_texts_per_s": round(ceiling, 1),
                "share_of_ceiling": round(texts / wall / ceiling, 3),
                "all_at_once_texts_per_s": round(texts / direct, 1),
                "share_of_all_at_once": round(direct / wall, 3),
                "client_cpu_ms_per_request": round(client_cpu * 1000 / len(sizes), 2),
                "fake_cpu_ms_per_request": round(fake_cpu * 1000 / len(sizes), 2),
                "load1_before": round(load_before, 2),
                "load1_after": round(os.getloadavg()[0], 2),
            }
        )
    header = (
        "| latency | requests (full) | texts/request | max in flight | texts/s | ceiling | share "
        "| one call of all texts: texts/s | share | CPU ms/request: client, fake | load 1-min |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['latency_ms']} ms | {row['requests']} ({row['full_requests']}) | {row['texts_per_request']} "
            f"| {row['max_in_flight_seen']} | {row['texts_per_s']} | {row['ceiling_texts_per_s']} "
            f"| {row['share_of_ceiling']:.1%} | {row['all_at_once_texts_per_s']} | {row['share_of_all_at_once']:.1%} "
            f"| {row['client_cpu_ms_per_request']}, {row['fake_cpu_ms_per_request']} "
            f"| {row['load1_before']} → {row['load1_after']} |"
        )
    print(json.dumps({"workers": args.workers, "dimension": args.dimension, "rows": rows}))


if __name__ == "__main__":
    main()
