"""``POST /v1/reindex`` queues a re-index to another embedding model; ``GET /v1/reindex`` shows its
progress and ``DELETE /v1/reindex`` cancels it; ``/v1/connections/{id}/reindex`` shows (``GET``) or
cancels (``DELETE``) a connection's, which a change of its ``config.embedding`` starts. Each is a
``reindex`` run (``/v1/runs``), executed by whichever replica's runner claims it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, Field

from ragstream.api.runs import RunState, kind_routes, run_fields
from ragstream.embedding.config import EmbedderConfig
from ragstream.embedding.spaces import ActiveSpace
from ragstream.storage.runs import Run, RunStore
from ragstream.storage.spaces import SpaceStore

__all__ = ["ReindexRequest", "ReindexStatus", "connection_reindex", "reindex_router", "spec_model_key"]


ReindexRequest = EmbedderConfig
"""The target embedder, as ``RAGSTREAM_EMBEDDER_*`` would configure it; the key is the process's own."""


class ReindexStatus(BaseModel):
    id: Annotated[int | None, Field(title="Run id", description="The run in /v1/runs.")] = None
    connection_id: Annotated[
        str | None, Field(title="Connection re-indexed", description="None: the connections following the default.")
    ] = None
    source_key: Annotated[str | None, Field(title="Embedding space searched until the switch")] = None
    target_key: Annotated[
        str | None, Field(title="Embedding space being built", description="None until the run has started.")
    ] = None
    status: Annotated[
        RunState,
        Field(title="Run status", description="`cancelled` or `failed`: starting it again resumes."),
    ]
    error: Annotated[str | None, Field(title="Why it failed or was cancelled")] = None
    chunks_total: Annotated[int, Field(title="Chunks to embed")] = 0
    chunks_embedded: Annotated[int, Field(title="Chunks with a vector in the target space")] = 0
    rate: Annotated[float | None, Field(title="Chunks per second")] = None
    eta_seconds: Annotated[float | None, Field(title="Estimated seconds left")] = None
    created_at: Annotated[datetime | None, Field(title="Queued at")] = None
    started_at: Annotated[datetime | None, Field(title="Started at")] = None
    heartbeat_at: Annotated[datetime | None, Field(title="Last progress write", description="At most seconds old.")] = (
        None
    )
    finished_at: datetime | None = None

    @classmethod
    def of(cls, run: Run) -> ReindexStatus:
        progress = run.progress
        return cls(
            **run_fields(run),
            connection_id=run.connection_id,
            source_key=run.params.get("source_key"),
            target_key=run.params.get("target_key"),
            chunks_total=progress.get("chunks_total", 0),
            chunks_embedded=progress.get("chunks_embedded", 0),
        )


def spec_model_key(spaces: ActiveSpace) -> Callable[[dict[str, Any]], Awaitable[str]]:
    """The model a deployment-wide re-index to a spec would build (``ValueError`` when it cannot)."""

    async def model_key(spec: dict[str, Any]) -> str:
        embedder = spaces.build(spec)
        try:
            return embedder.model_key
        finally:
            await embedder.aclose()

    return model_key


def connection_reindex(
    runs: RunStore, spaces: ActiveSpace, store: SpaceStore, wake: Callable[[], None]
) -> Callable[[str, dict[str, Any] | None], Awaitable[None]]:
    """What a change of a connection's ``config.embedding`` does: queue its re-index run to the model
    of the spec (None: back to the default). Refused before anything is queued: a model that cannot
    be built (a missing key) or that the connection uses already (``ValueError``, 422);
    ``RunInProgress`` while the connection's or a deployment-wide one is queued or running (409),
    ``UnknownConnection`` (404)."""

    async def start(connection_id: str, spec: dict[str, Any] | None) -> None:
        target = (await spaces.current()).embedder if spec is None else await spaces.resolve(spec)
        pinned, effective = await store.connection_model(connection_id)
        if effective == target.model_key and (pinned is not None) == (spec is not None):
            raise ValueError(f"{target.model_key} is already the embedding model of connection {connection_id}")
        await runs.start(connection_id, "api", kind="reindex", params={"spec": spec})
        wake()

    return start


def reindex_router(
    runs: RunStore,
    store: SpaceStore,
    target_key: Callable[[dict[str, Any]], Awaitable[str]],
    wake: Callable[[], None],
) -> APIRouter:
    """``target_key`` names the model a spec asks for (``ValueError`` when it cannot be built);
    ``wake`` tells the local runner a run was queued."""
    router = APIRouter()

    @router.post(
        "/v1/reindex",
        response_model=ReindexStatus,
        status_code=status.HTTP_202_ACCEPTED,
        responses={409: {"description": "A re-index (of the deployment or of a connection) is queued or running"}},
    )
    async def start_reindex(request: ReindexRequest) -> ReindexStatus:
        """Queue a re-index that builds the target model's index while search goes on with the current
        one; it is switched in atomically when complete. Progress: ``GET /v1/reindex``."""
        spec = request.model_dump()
        try:
            key = await target_key(spec)
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from None
        active = await store.active()
        if active is not None and active.model_key == key:
            raise HTTPException(status_code=422, detail=f"{key} is already the active embedding space")
        run = await runs.start(None, "api", kind="reindex", params={"spec": spec, "target_key": key})
        wake()
        return ReindexStatus.of(run)

    kind_routes(router, runs, "reindex", ReindexStatus, ReindexStatus.of, path="/v1/reindex", what="re-index")
    kind_routes(
        router,
        runs,
        "reindex",
        ReindexStatus,
        ReindexStatus.of,
        path="/v1/connections/{connection_id}/reindex",
        what="re-index",
        tags=["connections"],
    )
    return router
