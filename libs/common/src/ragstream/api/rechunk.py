"""``/v1/connections/{id}/rechunk``: rebuild a connection's chunks with a new chunking config, follow it, cancel it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Response, status
from pydantic import BaseModel, ConfigDict, Field

from ragstream.chunking import ChunkingConfig
from ragstream.rechunk import RechunkBusy, Rechunker, UnknownConnection
from ragstream.storage.rechunk import RechunkStore

__all__ = ["RechunkRequest", "RechunkStatus", "rechunk_router"]


class RechunkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Re-chunk request")

    chunking: Annotated[ChunkingConfig, Field(title="Chunking", description="The config to rebuild the index with.")]


class RechunkStatus(BaseModel):
    model_config = ConfigDict(title="Re-chunk run")

    connection_id: Annotated[str, Field(title="Connection id")]
    index_version: Annotated[int, Field(title="Index version being built", description="Searched once switched.")]
    chunking: Annotated[dict[str, Any], Field(title="Chunking config being built")]
    status: Annotated[
        Literal["running", "switched", "failed", "interrupted"],
        Field(title="Run status", description="`interrupted`: stopped midway; starting it again resumes."),
    ]
    error: Annotated[str | None, Field(title="Why it failed")] = None
    documents_total: Annotated[int, Field(title="Indexed documents of the connection")]
    documents_done: Annotated[int, Field(title="Documents rebuilt with the new config")]
    documents_failed: Annotated[int, Field(title="Documents that could not be rebuilt")]
    chunks: Annotated[int, Field(title="Chunks of the new version")]
    rate: Annotated[float | None, Field(title="Documents per second")] = None
    eta_seconds: Annotated[float | None, Field(title="Estimated seconds left")] = None
    started_at: datetime
    heartbeat_at: Annotated[datetime, Field(title="Last progress write", description="At most seconds old.")]
    finished_at: datetime | None = None


_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No such connection, or no re-chunk of it"}}


def rechunk_router(rechunker: Rechunker, store: RechunkStore) -> APIRouter:
    router = APIRouter(prefix="/v1/connections", tags=["connections"])

    async def latest(connection_id: str) -> RechunkStatus:
        run = await store.latest_run(connection_id)
        if run is None:
            raise HTTPException(status_code=404, detail=f"connection {connection_id!r} has no re-chunk")
        return RechunkStatus.model_validate(run, from_attributes=True)

    @router.post(
        "/{connection_id}/rechunk",
        response_model=RechunkStatus,
        status_code=status.HTTP_202_ACCEPTED,
        responses={**_NOT_FOUND, 409: {"description": "A re-chunk of this connection is running"}},
    )
    async def start_rechunk(connection_id: str, request: RechunkRequest) -> RechunkStatus:
        """Rebuild the connection's chunks with ``chunking`` in the background while search goes on with
        the current ones; switched in atomically when complete (the connection's config then shows it).
        Starting again after a failure or a cancellation resumes. Progress: ``GET`` on the same path."""
        try:
            await rechunker.start(connection_id, request.chunking)
        except UnknownConnection:
            raise HTTPException(status_code=404, detail=f"connection {connection_id!r} not found") from None
        except RechunkBusy as error:
            raise HTTPException(status_code=409, detail=str(error)) from None
        return await latest(connection_id)

    @router.get("/{connection_id}/rechunk", response_model=RechunkStatus, responses=_NOT_FOUND)
    async def rechunk_progress(connection_id: str) -> RechunkStatus:
        """The connection's latest re-chunk, from the database: any process's, written every few seconds."""
        return await latest(connection_id)

    @router.delete(
        "/{connection_id}/rechunk",
        status_code=204,
        response_class=Response,
        responses={404: {"description": "No re-chunk of this connection runs in this process"}},
    )
    async def cancel_rechunk(connection_id: str) -> Response:
        """Stop the running re-chunk; the current chunks stay searchable and starting it again resumes."""
        if not await rechunker.cancel(connection_id):
            raise HTTPException(status_code=404, detail=f"no re-chunk of {connection_id!r} runs here")
        return Response(status_code=204)

    return router
