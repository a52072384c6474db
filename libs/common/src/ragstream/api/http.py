"""FastAPI app: hybrid search, health and readiness, Prometheus metrics, and sync progress."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ragstream.metrics import SEARCH_LATENCY
from ragstream.pipeline import SyncProgress
from ragstream.retrieval import HybridRetriever, SearchRequest, SearchResponse

__all__ = ["create_app"]


def create_app(
    retriever: Callable[[], HybridRetriever | None],
    *,
    ready: Callable[[], Awaitable[bool]],
    sync_progress: Callable[[], dict[str, SyncProgress]] | None = None,
    title: str = "ragstream retriever",
) -> FastAPI:
    """``retriever`` is a getter because the app starts before the store is open; until then
    search answers 503 and readiness is false."""
    app = FastAPI(title=title, version="1")

    @app.post("/v1/search", response_model=SearchResponse)
    async def search(request: SearchRequest) -> SearchResponse:
        current = retriever()
        if current is None:
            raise HTTPException(status_code=503, detail="the index is still starting")
        with SEARCH_LATENCY.time():
            return await current.search(request)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict[str, str]:
        if await ready():
            return {"status": "ready"}
        response.status_code = 503
        return {"status": "starting"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if sync_progress is not None:
        progress_of = sync_progress

        @app.get("/v1/syncs")
        async def syncs() -> dict[str, Any]:
            """Progress of the latest sync of each source: counts, rate in documents per second."""
            return {
                connection: {
                    **asdict(progress),
                    "done": progress.done,
                    "failed": progress.failed,
                    "rate": round(progress.rate, 2),
                }
                for connection, progress in progress_of().items()
            }

    return app
