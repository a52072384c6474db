"""``/metrics`` of the embedded app after an ingest and searches: the production series move by what happened."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from ragstream.admission import SearchAdmission
from ragstream.api.auth import Access
from ragstream.connectors.folder import FolderConnector
from ragstream.embedded import api_app
from ragstream.metrics import exposition
from ragstream.retrieval import HybridRetriever, SearchRequest
from ragstream.runtime import Runtime
from ragstream.service import create_service_app
from ragstream.settings import Settings
from ragstream.storage.database import DatabaseBusy
from ragstream.storage.runs import RunStore
from tests.support.runs import sync_runner
from tests.test_grpc_api import BrokenRetriever, message_of, serving

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
async def admission() -> SearchAdmission:
    """One search at a time and none waiting: a second search at once is refused."""
    return SearchAdmission(max_in_flight=1, max_waiting=0, wait_timeout_s=5)


@pytest.fixture
async def embedded(runtime: Runtime, admission: SearchAdmission) -> AsyncIterator[FastAPI]:
    """The HTTP API of ``ragstream up``, open (no keys), with ``admission``."""
    runs = RunStore(runtime.pool, runtime.dsn, stale_timeout_s=1800)
    runner = sync_runner(runs, runtime.pipeline, max_concurrent=1, progress_interval_s=1)
    try:
        yield api_app(runtime, runs, runner, access=Access.open(), admission=admission)
    finally:
        await runs.aclose()


def samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return samples(response.text)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_ingest_and_search_move_the_production_series(
    runtime: Runtime, corpus: Path, embedded: FastAPI, admission: SearchAdmission
) -> None:
    (corpus / "kafka.md").write_text("# Kafka\n\n## Retention\n\nThe orderbook topic keeps data for 9 days.\n")
    (corpus / "pg.md").write_text("# PostgreSQL\n\n## Backups\n\nBase backups run nightly with pgBackRest.\n")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=embedded), base_url="http://test") as client:
        before = await scrape(client)

        report = await runtime.pipeline().sync(FolderConnector(corpus))
        assert report.ok and report.progress.indexed == 2
        searched = await client.post("/v1/search", json={"query": "orderbook retention", "top_k": 3})
        assert searched.status_code == 200 and searched.json()["results"]
        async with admission.admit():  # the only turn is taken: the next search is refused at once
            refused = await client.post("/v1/search", json={"query": "backups"})
        assert refused.status_code == 503

        after = await scrape(client)

    assert moved(before, after, "ragstream_documents_indexed_total", outcome="indexed") == 2
    assert moved(before, after, "ragstream_chunks_indexed_total") == report.progress.chunks > 0
    assert moved(before, after, "ragstream_search_requests_total", api="http", outcome="ok") == 1
    assert moved(before, after, "ragstream_search_requests_total", api="http", outcome="overloaded") == 1
    assert moved(before, after, "ragstream_search_rejections_total", reason="queue_full") == 1
    assert moved(before, after, "ragstream_search_seconds_count") == 1
    # One keyword leg, counted under whichever path answered it (that depends on the other tests' chunks).
    keyword = [key for key in after if key[0] == "ragstream_keyword_searches_total"]
    assert sum(after[key] - before.get(key, 0.0) for key in keyword) == 1
    assert moved(before, after, "ragstream_db_pool_wait_seconds_count") > 0


async def test_a_stage_service_serves_the_same_exposition_and_openmetrics_on_request() -> None:
    service = create_service_app("chunker", lambda broker, options: None, settings=Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=service), base_url="http://test") as client:
        text = await client.get("/metrics")
        openmetrics = await client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE ragstream_documents_indexed_total counter" in text.text
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")


async def test_grpc_searches_are_counted_by_outcome(runtime: Runtime) -> None:
    request = message_of(SearchRequest(query="annual leave"))

    async def search(retriever: HybridRetriever | BrokenRetriever) -> None:
        async with serving(lambda: retriever) as served:
            await served.stub.Search(request, timeout=30)

    before = samples(exposition(None)[0].decode())
    await search(runtime.retriever)
    for error in (DatabaseBusy("no connection"), RuntimeError("boom")):
        with pytest.raises(grpc.aio.AioRpcError):
            await search(BrokenRetriever(error))
    after = samples(exposition(None)[0].decode())
    for outcome in ("ok", "db_busy", "error"):
        assert moved(before, after, "ragstream_search_requests_total", api="grpc", outcome=outcome) == 1, outcome
