"""HTTP routes of sync runs: start one (409 while one is active), list them, a connection's status."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from ragstream.control.runs import RagDisabled, RunStatus, SyncInProgress, SyncRun, SyncRunStore
from ragstream.storage.cursors import Direction

__all__ = ["ConnectionSyncStatus", "SyncError", "SyncRunView", "sync_router"]

SyncError = Annotated[
    str | None,
    Field(
        title="What went wrong",
        description="The latest failed sync's reason, then the documents that did not index by code, e.g. "
        "'3 documents failed: 2 embedding_unavailable, 1 binary'. None when all is well.",
    ),
]

StatusLabel = Literal["Queued", "Syncing", "Ready", "Failed"]


class SyncRunView(BaseModel):
    id: Annotated[int, Field(title="Run id")]
    connection_id: Annotated[str, Field(title="Connection id")]
    trigger: Annotated[str, Field(title="What started it", description="api, create, schedule or cli.")]
    status: Annotated[StatusLabel, Field(title="Run status")]
    reason: Annotated[str | None, Field(title="Why it failed")] = None
    listed: Annotated[int, Field(title="Items listed at the origin so far")]
    unchanged: Annotated[int, Field(title="Listed items already indexed as they are")]
    changed: Annotated[int, Field(title="New or changed items announced")]
    indexed: Annotated[int, Field(title="Documents indexed")]
    deleted: Annotated[int, Field(title="Documents deleted")]
    failed: Annotated[int, Field(title="Documents that failed")]
    chunks: Annotated[int, Field(title="Chunks committed")]
    listing_done: Annotated[bool, Field(title="The listing is complete", description="Until then listed grows.")]
    direction: Annotated[
        Direction | None,
        Field(
            title="Which walk",
            description="backward: the first, full sync; forward: an incremental one (only changed items"
            " are downloaded). None until the walk has begun.",
        ),
    ] = None
    resumed: Annotated[
        bool, Field(title="Resumed an interrupted sync", description="Staged items were not downloaded again.")
    ] = False
    skipped: Annotated[
        int,
        Field(
            title="Entries left out of the listing",
            description="Symlinks, special files and unreadable entries of a folder: never indexed, each "
            "logged with its reason.",
        ),
    ] = 0
    rate: Annotated[float | None, Field(title="Documents per second")] = None
    eta_seconds: Annotated[float | None, Field(title="Seconds left at the current rate")] = None
    created_at: Annotated[datetime, Field(title="Queued at")]
    started_at: Annotated[datetime | None, Field(title="Started at")] = None
    heartbeat_at: Annotated[datetime | None, Field(title="Last progress at")] = None
    finished_at: Annotated[datetime | None, Field(title="Finished at")] = None

    @classmethod
    def of(cls, run: SyncRun) -> SyncRunView:
        return cls(
            id=run.id,
            connection_id=run.connection_id,
            trigger=run.trigger,
            status=status_label(run.status),
            reason=run.reason,
            listed=run.counts.listed,
            unchanged=run.counts.unchanged,
            changed=run.counts.changed,
            indexed=run.counts.indexed,
            deleted=run.counts.deleted,
            failed=run.counts.failed,
            chunks=run.counts.chunks,
            listing_done=run.counts.listing_done,
            direction=run.counts.direction,
            resumed=run.counts.resumed,
            skipped=run.counts.skipped,
            rate=run.rate,
            eta_seconds=run.eta_seconds,
            created_at=run.created_at,
            started_at=run.started_at,
            heartbeat_at=run.heartbeat_at,
            finished_at=run.finished_at,
        )


class ConnectionSyncStatus(BaseModel):
    connection_id: Annotated[str, Field(title="Connection id")]
    status: Annotated[StatusLabel | None, Field(title="Status of the latest run", description="None: never synced.")]
    reason: Annotated[str | None, Field(title="Why the latest run failed")] = None
    sync_error: SyncError = None
    progress: Annotated[SyncRunView | None, Field(title="The latest run with its counters, rate and ETA")] = None


def status_label(status: RunStatus) -> StatusLabel:
    labels: dict[RunStatus, StatusLabel] = {
        RunStatus.QUEUED: "Queued",
        RunStatus.SYNCING: "Syncing",
        RunStatus.READY: "Ready",
        RunStatus.FAILED: "Failed",
    }
    return labels[status]


def sync_router(runs: Callable[[], SyncRunStore | None], on_enqueued: Callable[[], None] | None = None) -> APIRouter:
    """``runs`` is a getter because the app starts before the store is open (503 until then);
    ``on_enqueued`` tells the local runner to claim a new run now rather than at its next poll."""
    router = APIRouter(prefix="/v1/connections", tags=["syncs"])

    async def store_of(connection_id: str) -> SyncRunStore:
        store = runs()
        if store is None:
            raise HTTPException(status_code=503, detail="the index is still starting")
        if await store.connection(connection_id) is None:
            raise HTTPException(status_code=404, detail="connection not found")
        return store

    @router.post(
        "/{connection_id}/sync",
        status_code=202,
        response_model=SyncRunView,
        responses={
            404: {"description": "No such connection"},
            409: {"description": "Sync already in progress, or RAG is off for the connection"},
        },
    )
    async def start_sync(connection_id: str) -> SyncRunView:
        """Queue an incremental sync; a run silent for longer than the stale timeout is failed and replaced."""
        store = await store_of(connection_id)
        try:
            run = await store.start(connection_id, "api")
        except (SyncInProgress, RagDisabled) as error:
            raise HTTPException(status_code=409, detail=str(error)) from error
        if on_enqueued is not None:
            on_enqueued()
        return SyncRunView.of(run)

    @router.get("/{connection_id}/syncs", response_model=list[SyncRunView])
    async def list_syncs(
        connection_id: str, limit: Annotated[int, Query(ge=1, le=100, description="Newest first.")] = 20
    ) -> list[SyncRunView]:
        store = await store_of(connection_id)
        return [SyncRunView.of(run) for run in await store.runs(connection_id, limit=limit)]

    @router.get("/{connection_id}/status", response_model=ConnectionSyncStatus)
    async def sync_status(connection_id: str) -> ConnectionSyncStatus:
        store = await store_of(connection_id)
        await store.reap(connection_id)  # a run whose owner died shows Failed, not Syncing
        latest = await store.latest(connection_id)
        sync_error = await store.sync_error(connection_id)
        if latest is None:
            return ConnectionSyncStatus(connection_id=connection_id, status=None, sync_error=sync_error)
        return ConnectionSyncStatus(
            connection_id=connection_id,
            status=status_label(latest.status),
            reason=latest.reason,
            sync_error=sync_error,
            progress=SyncRunView.of(latest),
        )

    return router
