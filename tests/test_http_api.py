"""The HTTP search API of the embedded mode and the retriever: fields, limits, probes, metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.connectors.folder import FolderConnector
from ragstream.runtime import Runtime

pytestmark = pytest.mark.integration


async def ready() -> bool:
    return True


async def test_search_returns_the_contract_fields(runtime: Runtime, corpus: Path) -> None:
    (corpus / "kafka.md").write_text("# Kafka\n\n## Retention\n\nThe orderbook topic keeps data for 9 days.\n")
    (corpus / "pg.md").write_text("# PostgreSQL\n\n## Backups\n\nBase backups run nightly with pgBackRest.\n")
    assert (await runtime.pipeline().sync(FolderConnector(corpus))).ok
    app = create_app(lambda: runtime.retriever, ready=ready)
    scope = [FolderConnector(corpus).connection_id]

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.post(
            "/v1/search",
            json={
                "query": "orderbook retention",
                "top_k": 2,
                "filters": {"connection_ids": scope},
            },
        )
        assert response.status_code == 200
        results = response.json()["results"]
        assert len(results) == 2
        first = results[0]
        assert (first["rank"], first["citation_index"], first["source"], first["title"]) == (1, 1, "kafka.md", "Kafka")
        assert first["keyword_rank"] == 1 and first["score"] > results[1]["score"]
        assert "orderbook" in first["text"] and first["heading"] == "Kafka"
        assert results[1]["citation_index"] == 2

        assert (await client.post("/v1/search", json={"query": "x", "top_k": 31})).status_code == 422
        assert (await client.post("/v1/search", json={"query": ""})).status_code == 422
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        assert (await client.get("/readyz")).status_code == 200
        assert "ragstream_search_seconds_count" in (await client.get("/metrics")).text


async def test_search_answers_503_until_the_index_is_open() -> None:
    async def not_ready() -> bool:
        return False

    app = create_app(lambda: None, ready=not_ready)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.post("/v1/search", json={"query": "x"})).status_code == 503
        assert (await client.get("/readyz")).status_code == 503
