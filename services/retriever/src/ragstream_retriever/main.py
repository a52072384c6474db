"""retriever service: ``POST /v1/search`` (vector + keyword, fused), ``GET /v1/documents/{id}`` and the
knowledge tool's read-side actions (``POST /v1/knowledge``), with health, readiness and metrics; the
same search and knowledge tool over gRPC on ``RAGSTREAM_GRPC_PORT``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from ragstream.admission import SearchAdmission
from ragstream.api.auth import Access
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app as create_search_app
from ragstream.api.knowledge import knowledge_router
from ragstream.knowledge.service import KnowledgeService
from ragstream.logs import configure_logging
from ragstream.retrieval.reader import DocumentReader
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.runtime import Runtime, open_runtime, warm_keyword_lists
from ragstream.settings import Settings
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import ping
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.telemetry import tracer_provider

__all__ = ["create_app"]


def create_app() -> FastAPI:
    """Refuses to build without ``RAGSTREAM_API_KEYS`` unless ``RAGSTREAM_AUTH=none``."""
    settings = Settings()
    configure_logging(settings.logs)
    tracer_provider("retriever")  # HTTP spans, exported over OTLP when an endpoint is set
    access = Access.for_service(settings, "retriever")
    state: dict[str, Runtime] = {}
    readers: dict[str, DocumentReader] = {}
    searchers: dict[str, SearchWithDirect] = {}
    tools: dict[str, KnowledgeService] = {}

    admission = SearchAdmission.from_settings(settings)

    async def ready() -> bool:
        runtime = state.get("runtime")
        if runtime is None:
            return False
        await ping(runtime.pool, settings.readiness_timeout_s)
        return True

    app = create_search_app(
        lambda: searchers.get("searcher"),
        ready=ready,
        reader=lambda: readers.get("reader"),
        # Search, read and list_documents; writes belong to the control plane, which starts the sync.
        routers=[knowledge_router(lambda: tools.get("knowledge"), admission=admission)],
        access=access,
        max_request_bytes=settings.max_request_bytes,
        admission=admission,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not settings.database_url:
            raise RuntimeError("DATABASE_URL must be set for the retriever service")
        async with AsyncExitStack() as stack:
            runtime = await stack.enter_async_context(open_runtime(settings, settings.database_url))
            await runtime.embedder.warm_up()
            warming = asyncio.create_task(warm_keyword_lists(runtime))
            stack.callback(warming.cancel)
            state["runtime"] = runtime
            searcher = runtime.searcher()
            searchers["searcher"] = searcher
            stack.push_async_callback(searcher.aclose)
            stack.callback(searchers.clear)
            readers["reader"] = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
            tools["knowledge"] = runtime.knowledge(lambda: searcher)
            stack.callback(state.clear)
            stack.callback(readers.clear)
            stack.callback(tools.clear)
            if settings.grpc_port:
                await stack.enter_async_context(
                    grpc_server(
                        lambda: searcher,
                        knowledge=lambda: tools.get("knowledge"),
                        host=settings.grpc_host,
                        port=settings.grpc_port,
                        ready=ready,
                        access=access,
                        max_receive_bytes=settings.max_request_bytes,
                        admission=admission,
                        grace_s=settings.shutdown_timeout_s,
                    )
                )
            yield

    app.router.lifespan_context = lifespan
    return app
