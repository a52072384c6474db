"""FastAPI app: hybrid search, document reads, connections, health and readiness, Prometheus metrics, sync progress."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ragstream.api.admission import Overloaded, SearchAdmission
from ragstream.api.auth import Access, check_principal, protect, search_route
from ragstream.metrics import SEARCH_LATENCY
from ragstream.pipeline import SyncProgress
from ragstream.retrieval import HybridRetriever, Principal, SearchRequest, SearchResponse
from ragstream.retrieval.budget import MAX_CALL_CHARS
from ragstream.retrieval.reader import DocumentRead, DocumentReader
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.storable import Storable, StorableStr
from ragstream.storage.database import DatabaseBusy, DatabaseUnavailable

__all__ = ["create_app"]


def create_app(
    retriever: Callable[[], HybridRetriever | SearchWithDirect | None],
    *,
    ready: Callable[[], Awaitable[bool]],
    sync_progress: Callable[[], dict[str, SyncProgress]] | None = None,
    reader: Callable[[], DocumentReader | None] | None = None,
    routers: Sequence[APIRouter] = (),
    title: str = "ragstream retriever",
    access: Access | None = None,
    max_request_bytes: int = 1024 * 1024,
    admission: SearchAdmission | None = None,
) -> FastAPI:
    """``retriever`` (and ``reader``, which adds ``GET /v1/documents/{id}``) are getters because the
    app starts before the store is open; until then search and reads answer 503 and readiness is false.
    ``routers`` add the control plane where the process has one (connections, replays).
    Every route is behind ``access`` (see :mod:`ragstream.api.auth`); without one, every call is
    allowed, as ``ragstream up`` on loopback without keys.
    ``admission`` limits the searches running and waiting (shared with the gRPC API); beyond it, and
    when the database gives no connection in time, a call answers 503 with ``Retry-After``.
    ``ready`` raises (or answers false) when the database cannot serve: ``/readyz`` says why."""
    app = FastAPI(title=title, version="1")
    protect(app, access or Access.open(), max_request_bytes=max_request_bytes)
    for router in routers:
        app.include_router(router)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 echoes the offending input, which can be a credential or the whole body
        # around one: answer with where and why only.
        problems = [{key: value for key, value in problem.items() if key != "input"} for problem in error.errors()]
        return JSONResponse(status_code=422, content={"detail": jsonable_encoder(problems)})

    @app.exception_handler(DatabaseBusy)
    async def database_busy(request: Request, error: DatabaseBusy) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": "the database is busy"}, headers={"Retry-After": "1"})

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, error: Overloaded) -> JSONResponse:
        return JSONResponse(
            status_code=503,
            content={"detail": "too many searches at once"},
            headers={"Retry-After": str(error.retry_after_s)},
        )

    @app.post("/v1/search", response_model=SearchResponse)
    @search_route
    async def search(request: SearchRequest, http: Request) -> SearchResponse:
        check_principal(http, request.principal is not None)
        current = retriever()
        if current is None:
            raise HTTPException(status_code=503, detail="the index is still starting")
        async with admission.admit() if admission is not None else contextlib.nullcontext():
            with SEARCH_LATENCY.time():
                return await current.search(request)

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
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if reader is not None:
        reader_of = reader

        @app.get(
            "/v1/documents/{document_id}",
            response_model=DocumentRead,
            responses={404: {"description": "No such document, or not one the caller may see (the same answer)"}},
        )
        @search_route
        async def read_document(
            http: Request,
            document_id: StorableStr,
            conversation_id: Annotated[
                str | None,
                Query(max_length=200, description="Keeps the citation number of earlier searches."),
                Storable,
            ] = None,
            user: Annotated[
                str | None, Query(min_length=1, description="Caller; without one, only unrestricted chunks."), Storable
            ] = None,
            groups: Annotated[
                list[StorableStr], Query(description="Caller's groups: repeated or comma-separated.")
            ] = [],  # noqa: B006
            max_chars: Annotated[int, Query(ge=1, le=MAX_CALL_CHARS, description="Text budget.")] = MAX_CALL_CHARS,
        ) -> DocumentRead:
            """The document's text (chunks in order, cut to the budget) and its source-card fields,
            under the same scope and permission rules as search."""
            check_principal(http, user is not None)
            current = reader_of()
            if current is None:
                raise HTTPException(status_code=503, detail="the index is still starting")
            names = [name for value in groups for name in value.split(",") if name]
            if names and user is None:
                raise HTTPException(status_code=422, detail="groups need a user")
            principal = Principal(user=user, groups=names) if user is not None else None
            document = await current.read(document_id, principal, conversation_id=conversation_id, max_chars=max_chars)
            if document is None:
                raise HTTPException(status_code=404, detail="document not found")
            return document

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
