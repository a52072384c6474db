"""``POST /v1/reindex`` starts a re-index to another embedding model; ``GET /v1/reindex`` shows its progress;
``/v1/connections/{id}/reindex`` shows (``GET``) or cancels (``DELETE``) a connection's, which a change of
its ``config.embedding`` starts."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Response, status
from pydantic import BaseModel, Field

from ragstream.embedding.config import EmbedderConfig
from ragstream.reindex import ReindexBusy, Reindexer
from ragstream.storage.spaces import SpaceStore

__all__ = ["ReindexRequest", "ReindexStatus", "reindex_router"]


ReindexRequest = EmbedderConfig
"""The target embedder, as ``RAGSTREAM_EMBEDDER_*`` would configure it; the key is the process's own."""


class ReindexStatus(BaseModel):
    connection_id: Annotated[
        str | None, Field(title="Connection re-indexed", description="None: the connections following the default.")
    ] = None
    source_key: Annotated[str | None, Field(title="Embedding space searched until the switch")]
    target_key: Annotated[str, Field(title="Embedding space being built")]
    status: Annotated[
        Literal["running", "switched", "failed", "interrupted"],
        Field(title="Run status", description="`interrupted`: stopped midway; starting it again resumes."),
    ]
    error: Annotated[str | None, Field(title="Why it failed")] = None
    chunks_total: Annotated[int, Field(title="Chunks to embed")]
    chunks_embedded: Annotated[int, Field(title="Chunks with a vector in the target space")]
    rate: Annotated[float | None, Field(title="Chunks per second")] = None
    eta_seconds: Annotated[float | None, Field(title="Estimated seconds left")] = None
    started_at: datetime
    heartbeat_at: Annotated[datetime, Field(title="Last progress write", description="At most seconds old.")]
    finished_at: datetime | None = None


_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No re-index of this connection"}}


def reindex_router(reindexer: Reindexer, store: SpaceStore) -> APIRouter:
    router = APIRouter()

    async def latest(connection_id: str | None = None) -> ReindexStatus:
        run = await store.latest_run(connection_id)
        if run is None:
            whose = f" of connection {connection_id!r}" if connection_id else ""
            raise HTTPException(status_code=404, detail=f"no re-index{whose} has run")
        return ReindexStatus.model_validate(run, from_attributes=True)

    @router.post("/v1/reindex", response_model=ReindexStatus, status_code=status.HTTP_202_ACCEPTED)
    async def start_reindex(request: ReindexRequest) -> ReindexStatus:
        """Build the target model's index in the background while search goes on with the current one;
        it is switched in atomically when complete. Progress: ``GET /v1/reindex``."""
        try:
            await reindexer.start(request.model_dump())
        except ReindexBusy as error:
            raise HTTPException(status_code=409, detail=str(error)) from None
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from None
        return await latest()

    @router.get("/v1/reindex", response_model=ReindexStatus)
    async def reindex_progress() -> ReindexStatus:
        """The latest re-index, from the database: any process's, written at least every few seconds."""
        return await latest()

    @router.get(
        "/v1/connections/{connection_id}/reindex",
        response_model=ReindexStatus,
        responses=_NOT_FOUND,
        tags=["connections"],
    )
    async def connection_reindex_progress(connection_id: str) -> ReindexStatus:
        """The connection's latest re-index (started by changing its ``config.embedding``), from the
        database: any process's, written at least every few seconds."""
        return await latest(connection_id)

    @router.delete(
        "/v1/connections/{connection_id}/reindex",
        status_code=204,
        response_class=Response,
        responses={404: {"description": "No re-index of this connection runs in this process"}},
        tags=["connections"],
    )
    async def cancel_connection_reindex(connection_id: str) -> Response:
        """Stop the connection's running re-index; its current vectors stay searchable, and setting the
        same ``config.embedding`` again resumes it."""
        if not await reindexer.cancel(connection_id):
            raise HTTPException(status_code=404, detail=f"no re-index of {connection_id!r} runs here")
        return Response(status_code=204)

    return router
