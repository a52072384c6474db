"""``POST /v1/reindex`` starts a re-index to another embedding model; ``GET /v1/reindex`` shows its progress."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, Field

from ragstream.reindex import ReindexBusy, Reindexer
from ragstream.storage.spaces import SpaceStore

__all__ = ["ReindexRequest", "ReindexStatus", "reindex_router"]


class ReindexRequest(BaseModel):
    """The target embedder, as ``RAGSTREAM_EMBEDDER_*`` would configure it; the key is the process's own."""

    provider: Annotated[Literal["local", "dashscope", "openai"], Field(title="Embedding provider")]
    model: Annotated[str | None, Field(title="Model name", description="Provider default when unset.")] = None
    dimension: Annotated[int | None, Field(title="Vector dimension", ge=1, description="Provider default.")] = None
    base_url: Annotated[str | None, Field(title="Endpoint base URL")] = None


class ReindexStatus(BaseModel):
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


def reindex_router(reindexer: Reindexer, store: SpaceStore) -> APIRouter:
    router = APIRouter()

    async def latest() -> ReindexStatus:
        run = await store.latest_run()
        if run is None:
            raise HTTPException(status_code=404, detail="no re-index has run")
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

    return router
