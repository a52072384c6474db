"""``/v1/connections/{id}/rechunk``: rebuild a connection's chunks with a new chunking config, follow it,
cancel it. Each is a ``rechunk`` run (``/v1/runs``), executed by whichever replica's runner claims it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, status
from pydantic import BaseModel, ConfigDict, Field

from ragstream.api.runs import RunState, kind_routes, run_fields
from ragstream.chunking import ChunkingConfig
from ragstream.storage.runs import Run, RunStore

__all__ = ["RechunkRequest", "RechunkStatus", "connection_rechunk", "rechunk_router"]


class RechunkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Re-chunk request")

    chunking: Annotated[ChunkingConfig, Field(title="Chunking", description="The config to rebuild the index with.")]


class RechunkStatus(BaseModel):
    model_config = ConfigDict(title="Re-chunk run")

    id: Annotated[int | None, Field(title="Run id", description="The run in /v1/runs.")] = None
    connection_id: Annotated[str, Field(title="Connection id")]
    index_version: Annotated[
        int | None,
        Field(title="Index version being built", description="Searched once switched; None until the run started."),
    ] = None
    chunking: Annotated[dict[str, Any], Field(title="Chunking config being built")]
    status: Annotated[
        RunState,
        Field(title="Run status", description="`cancelled` or `failed`: starting it again resumes."),
    ]
    error: Annotated[str | None, Field(title="Why it failed or was cancelled")] = None
    documents_total: Annotated[int, Field(title="Indexed documents of the connection")] = 0
    documents_done: Annotated[int, Field(title="Documents rebuilt with the new config")] = 0
    documents_failed: Annotated[int, Field(title="Documents that could not be rebuilt")] = 0
    chunks: Annotated[int, Field(title="Chunks of the new version")] = 0
    rate: Annotated[float | None, Field(title="Documents per second")] = None
    eta_seconds: Annotated[float | None, Field(title="Estimated seconds left")] = None
    created_at: Annotated[datetime | None, Field(title="Queued at")] = None
    started_at: Annotated[datetime | None, Field(title="Started at")] = None
    heartbeat_at: Annotated[datetime | None, Field(title="Last progress write", description="At most seconds old.")] = (
        None
    )
    finished_at: datetime | None = None

    @classmethod
    def of(cls, run: Run) -> RechunkStatus:
        progress = run.progress
        assert run.connection_id is not None, "a re-chunk run has a connection"
        return cls(
            **run_fields(run),
            connection_id=run.connection_id,
            index_version=run.params.get("index_version"),
            chunking=run.params.get("chunking", {}),
            documents_total=progress.get("documents_total", 0),
            documents_done=progress.get("documents_done", 0),
            documents_failed=progress.get("documents_failed", 0),
            chunks=progress.get("chunks", 0),
        )


def _start(runs: RunStore, connection_id: str, chunking: ChunkingConfig) -> Awaitable[Run]:
    return runs.start(connection_id, "api", kind="rechunk", params={"chunking": chunking.model_dump(mode="json")})


def connection_rechunk(runs: RunStore, wake: Callable[[], None]) -> Callable[[str, ChunkingConfig], Awaitable[None]]:
    """What a change of a connection's chunking config does: queue its re-chunk run; ``RunInProgress``
    (a 409) while one is active."""

    async def start(connection_id: str, chunking: ChunkingConfig) -> None:
        await _start(runs, connection_id, chunking)
        wake()

    return start


def rechunk_router(runs: RunStore, wake: Callable[[], None]) -> APIRouter:
    """``wake`` tells the local runner a run was queued."""
    router = APIRouter(prefix="/v1/connections", tags=["connections"])

    @router.post(
        "/{connection_id}/rechunk",
        response_model=RechunkStatus,
        status_code=status.HTTP_202_ACCEPTED,
        responses={
            404: {"description": "No such connection"},
            409: {"description": "A re-chunk of this connection is queued or running"},
        },
    )
    async def start_rechunk(connection_id: str, request: RechunkRequest) -> RechunkStatus:
        """Queue a rebuild of the connection's chunks with ``chunking`` while search goes on with the
        current ones; switched in atomically when complete (the connection's config then shows it).
        Starting again after a failure or a cancellation resumes. Progress: ``GET`` on the same path."""
        run = await _start(runs, connection_id, request.chunking)
        wake()
        return RechunkStatus.of(run)

    kind_routes(
        router, runs, "rechunk", RechunkStatus, RechunkStatus.of, path="/{connection_id}/rechunk", what="re-chunk"
    )
    return router
