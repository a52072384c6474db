"""FastAPI app: hybrid search, document reads, the routers a process adds, health and readiness, Prometheus metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager

import asyncpg
from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ragstream.admission import SearchAdmission, counted_search
from ragstream.api.auth import Access, check_principal, protect, search_route
from ragstream.api.documents import documents_router
from ragstream.api.errors import install_error_handlers
from ragstream.metrics import SEARCH_LATENCY, exposition
from ragstream.retrieval import HybridRetriever, SearchRequest, SearchResponse
from ragstream.retrieval.reader import DocumentReader
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.storage.database import DatabaseBusy, DatabaseUnavailable

__all__ = ["create_app"]


def create_app(
    retriever: Callable[[], HybridRetriever | SearchWithDirect | None] | None,
    *,
    ready: Callable[[], Awaitable[bool]],
    reader: Callable[[], DocumentReader | None] | None = None,
    routers: Sequence[APIRouter] = (),
    title: str = "ragstream retriever",
    access: Access | None = None,
    max_request_bytes: int = 1024 * 1024,
    admission: SearchAdmission | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """``retriever`` (and ``reader``, which adds ``GET /v1/documents/{id}``) are getters because the
    app starts before the store is open; until then search and reads answer 503 and readiness is false.
    Without a ``retriever`` the app has no search (the connector-fetcher: search is the retriever's).
    ``routers`` add the control plane where the process has one (see :mod:`ragstream.api.control_plane`).
    Every route is behind ``access`` (see :mod:`ragstream.api.auth`); without one, every call is
    allowed, as ``ragstream up`` on loopback without keys.
    ``admission`` limits the searches running and waiting (shared with the gRPC API); beyond it, and
    when the database gives no connection in time, a call answers 503 with ``Retry-After`` (an error
    a route leaves unhandled answers as :mod:`ragstream.api.errors` maps its family).
    ``ready`` raises (or answers false) when the database cannot serve: ``/readyz`` says why.
    ``lifespan`` opens and closes what the process needs around serving."""
    app = FastAPI(title=title, version="1", lifespan=lifespan)
    protect(app, access or Access.open(), max_request_bytes=max_request_bytes)
    for router in routers:
        app.include_router(router)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 echoes the offending input, which can be a credential or the whole body
        # around one: answer with where and why only.
        problems = [{key: value for key, value in problem.items() if key != "input"} for problem in error.errors()]
        return JSONResponse(status_code=422, content={"detail": jsonable_encoder(problems)})

    install_error_handlers(app)

    if retriever is not None:
        app.include_router(_search_router(retriever, admission))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict[str, str]:
        try:
            if await ready():
                return {"status": "ready"}
            status = {"status": "starting"}
        except (DatabaseBusy, DatabaseUnavailable) as error:
            status = {"status": "unavailable", "reason": str(error)}
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            status = {"status": "unavailable", "reason": "the database cannot be reached"}
        response.status_code = 503
        return status

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    if reader is not None:
        app.include_router(documents_router(reader))

    return app


def _search_router(
    retriever: Callable[[], HybridRetriever | SearchWithDirect | None], admission: SearchAdmission | None
) -> APIRouter:
    router = APIRouter(tags=["search"])

    @router.post("/v1/search", response_model=SearchResponse)
    @search_route
    async def search(request: SearchRequest, http: Request) -> SearchResponse:
        check_principal(http, request.principal is not None)
        current = retriever()
        if current is None:
            raise HTTPException(status_code=503, detail="the index is still starting")
        with counted_search("http"):
            async with admission.admit() if admission is not None else contextlib.nullcontext():
                with SEARCH_LATENCY.time():
                    return await current.search(request)

    return router
