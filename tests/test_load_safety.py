"""Under load the retriever degrades cleanly: no pool deadlock, bounded admission, honest readiness."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragstream.admission import SearchAdmission
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.connectors.folder import FolderConnector
from ragstream.embedding.base import Embedder, TextKind, Vectors
from ragstream.embedding.spaces import ActiveSpace
from ragstream.retrieval import HybridRetriever
from ragstream.runtime import Runtime
from ragstream.settings import Settings
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import DatabaseBusy, close_pool, connect_pool, ping
from ragstream.storage.search import SearchStore
from ragstream.storage.spaces import SpaceStore
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc

pytestmark = pytest.mark.integration

QUERY = {"query": "orderbook retention"}


class GatedEmbedder:
    """The session's embedder, whose query embeddings wait until ``release`` is set: a search using
    it stays in flight, holding its snapshot, for as long as a test needs."""

    def __init__(self, inner: Embedder) -> None:
        self._inner = inner
        self.model_key = inner.model_key
        self.dimension = inner.dimension
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def warm_up(self) -> None:
        return None

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        self.entered.set()
        await self.release.wait()
        return await self._inner.embed(texts, kind)

    async def aclose(self) -> None:
        return None


@pytest.fixture
async def indexed(runtime: Runtime, corpus: Path) -> str:
    (corpus / "kafka.md").write_text("# Kafka\n\n## Retention\n\nThe orderbook topic keeps data for 9 days.\n")
    (corpus / "pg.md").write_text("# PostgreSQL\n\n## Backups\n\nBase backups run nightly with pgBackRest.\n")
    assert (await runtime.pipeline().sync(FolderConnector(corpus))).ok
    return FolderConnector(corpus).connection_id


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Wait for ``check`` to hold; the bound only ends a test that would otherwise hang."""
    for _ in range(1500):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the expected state never came")


@asynccontextmanager
async def serving(retriever: HybridRetriever, admission: SearchAdmission | None = None) -> AsyncIterator[Any]:
    """A gRPC server of ``retriever`` on a free loopback port, and a stub of it."""
    async with (
        grpc_server(lambda: retriever, host="127.0.0.1", port=0, admission=admission) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield retrieval_pb2_grpc.RetrievalStub(channel)


@asynccontextmanager
async def small_pool(database_url: str, acquire_timeout_s: float) -> AsyncIterator[asyncpg.Pool]:
    pool = await connect_pool(database_url, min_size=0, max_size=2, acquire_timeout_s=acquire_timeout_s)
    try:
        yield pool
    finally:
        await close_pool(pool, 5)


def retriever_on(
    pool: asyncpg.Pool, runtime: Runtime, embedder: Embedder | None = None, **store: float
) -> HybridRetriever:
    """The session's retrieval wiring on ``pool``; the layout cache never holds (TTL 0), so every
    search reads the space layout again, as searches do whenever the TTL runs out under load."""
    spaces = ActiveSpace(SpaceStore(pool), runtime.settings.embedding, embedder or runtime.embedder, ttl_s=0)
    return HybridRetriever(SearchStore(pool, **store), embedder or runtime.embedder, CitationStore(pool), spaces=spaces)


def client_of(
    retriever: HybridRetriever, pool: asyncpg.Pool, admission: SearchAdmission | None = None
) -> httpx.AsyncClient:
    async def ready() -> bool:
        await ping(pool, 0.2)
        return True

    app = create_app(lambda: retriever, ready=ready, admission=admission)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


async def test_concurrent_searches_on_a_small_pool_refreshing_the_layout_all_succeed(
    runtime: Runtime, database_url: str, indexed: str
) -> None:
    """16 searches on 2 connections while the layout is re-read: a search that held its snapshot
    while it waited for a second connection to refresh the layout deadlocked here (every connection
    held by a snapshot waiting for one more). The acquire timeout is long: only a wedge reaches it."""
    async with small_pool(database_url, acquire_timeout_s=60) as pool:
        retriever = retriever_on(pool, runtime)
        async with client_of(retriever, pool) as client:
            scoped = {**QUERY, "filters": {"connection_ids": [indexed]}}
            answers = await asyncio.gather(*(client.post("/v1/search", json=scoped) for _ in range(16)))
            assert [answer.status_code for answer in answers] == [200] * 16
            assert all(answer.json()["results"][0]["source"] == "kafka.md" for answer in answers)
            assert (await client.post("/v1/search", json=QUERY)).status_code == 200
            assert (await client.get("/readyz")).status_code == 200


async def test_an_exhausted_pool_is_a_clean_503_and_not_ready_then_recovers(
    runtime: Runtime, database_url: str, indexed: str
) -> None:
    async with small_pool(database_url, acquire_timeout_s=0.2) as pool:
        retriever = retriever_on(pool, runtime)
        async with client_of(retriever, pool) as client:
            held = [await pool.acquire(timeout=5) for _ in range(2)]
            search = await client.post("/v1/search", json=QUERY)
            assert (search.status_code, search.headers["retry-after"]) == (503, "1")
            assert search.json() == {"detail": "the database is busy"}
            readiness = await client.get("/readyz")
            assert readiness.status_code == 503
            assert readiness.json() == {"status": "unavailable", "reason": "no database connection free within 0.2 s"}
            assert (await client.get("/healthz")).status_code == 200
            with pytest.raises(DatabaseBusy):
                await pool.fetchval("SELECT 1")

            async with serving(retriever) as stub:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.Search(retrieval_pb2.SearchRequest(query=QUERY["query"]), timeout=30)
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
                assert ("grpc-retry-pushback-ms", "1000") in tuple(raised.value.trailing_metadata() or ())

            for connection in held:
                await pool.release(connection)
            assert (await client.post("/v1/search", json=QUERY)).status_code == 200
            assert (await client.get("/readyz")).json() == {"status": "ready"}


async def test_grpc_health_is_not_serving_while_the_pool_is_exhausted(runtime: Runtime, database_url: str) -> None:
    async with small_pool(database_url, acquire_timeout_s=0.2) as pool:

        async def ready() -> bool:
            await ping(pool, 0.2)
            return True

        held = [await pool.acquire(timeout=5) for _ in range(2)]
        async with (
            grpc_server(lambda: None, host="127.0.0.1", port=0, ready=ready, health_interval_s=0.05) as port,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)

            async def status_is(status: int) -> bool:
                return bool((await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == status)

            await eventually(lambda: status_is(health_pb2.HealthCheckResponse.NOT_SERVING))
            for connection in held:
                await pool.release(connection)
            await eventually(lambda: status_is(health_pb2.HealthCheckResponse.SERVING))


async def test_admission_refuses_beyond_the_limit_over_http_and_grpc_with_retry_after(
    runtime: Runtime, database_url: str, indexed: str
) -> None:
    """One search in flight (held on its query embedding) and one waiting fill the limiter, which
    the HTTP and gRPC APIs share: the next caller of either is refused at once, the others finish."""
    embedder = GatedEmbedder(runtime.embedder)
    admission = SearchAdmission(max_in_flight=1, max_waiting=1, wait_timeout_s=120)
    async with small_pool(database_url, acquire_timeout_s=60) as pool:
        retriever = retriever_on(pool, runtime, embedder)
        async with (
            client_of(retriever, pool, admission) as client,
            serving(retriever, admission) as stub,
        ):
            running = asyncio.create_task(client.post("/v1/search", json=QUERY))
            await embedder.entered.wait()
            waiting = asyncio.create_task(client.post("/v1/search", json=QUERY))

            async def one_waits() -> bool:
                return admission.waiting == 1

            await eventually(one_waits)

            refused = await client.post("/v1/search", json=QUERY)
            assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
            assert refused.json() == {"detail": "too many searches at once"}
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Search(retrieval_pb2.SearchRequest(query=QUERY["query"]), timeout=30)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("grpc-retry-pushback-ms", "1000") in tuple(raised.value.trailing_metadata() or ())
            assert not running.done() and not waiting.done()

            embedder.release.set()
            assert [(await task).status_code for task in (running, waiting)] == [200, 200]
            assert (await stub.Search(retrieval_pb2.SearchRequest(query=QUERY["query"]), timeout=30)).results


async def test_a_search_waiting_past_its_turn_timeout_is_refused(
    runtime: Runtime, database_url: str, indexed: str
) -> None:
    embedder = GatedEmbedder(runtime.embedder)
    admission = SearchAdmission(max_in_flight=1, max_waiting=4, wait_timeout_s=0.1)
    async with small_pool(database_url, acquire_timeout_s=60) as pool:
        retriever = retriever_on(pool, runtime, embedder)
        async with client_of(retriever, pool, admission) as client:
            running = asyncio.create_task(client.post("/v1/search", json=QUERY))
            await embedder.entered.wait()
            late = await client.post("/v1/search", json=QUERY)  # the running one never ends before release
            assert (late.status_code, late.headers["retry-after"]) == (503, "1")
            embedder.release.set()
            assert (await running).status_code == 200
            assert admission.waiting == 0


async def test_a_search_statement_past_its_timeout_is_a_503(runtime: Runtime, database_url: str, indexed: str) -> None:
    """A re-index switch holds chunks exclusively: a search waiting for it longer than the search
    statement timeout gives up with 503 instead of holding its connection."""
    async with small_pool(database_url, acquire_timeout_s=60) as pool:
        retriever = retriever_on(pool, runtime, statement_timeout_s=0.2)
        async with client_of(retriever, pool) as client:
            blocker = await asyncpg.connect(database_url)
            try:
                async with blocker.transaction():
                    await blocker.execute("LOCK TABLE chunks IN ACCESS EXCLUSIVE MODE")
                    answer = await client.post("/v1/search", json=QUERY)
                    assert (answer.status_code, answer.headers["retry-after"]) == (503, "1")
            finally:
                await blocker.close()
            assert (await client.post("/v1/search", json=QUERY)).status_code == 200


async def test_closing_a_pool_terminates_a_connection_held_for_ever(database_url: str) -> None:
    pool = await connect_pool(database_url, min_size=0, max_size=2, acquire_timeout_s=5)
    held = await pool.acquire()
    backend = held.get_server_pid()
    await close_pool(pool, 0.2)
    observer = await asyncpg.connect(database_url)

    async def backend_gone() -> bool:
        return not await observer.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend)

    try:
        await eventually(backend_gone)
    finally:
        await observer.close()


def test_admission_limits_follow_the_pool_size() -> None:
    admission = SearchAdmission.from_settings(Settings(db_pool_size=8))
    assert (admission.max_in_flight, admission.max_waiting) == (6, 96)
    assert SearchAdmission.from_settings(Settings(db_pool_size=2)).max_in_flight == 1
