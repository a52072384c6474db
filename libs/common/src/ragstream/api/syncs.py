"""HTTP routes of sync runs: start one (409 while one is active), list them, a connection's status;
``/v1/syncs``: a folder synced by its path, and the live progress of this process's syncs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from ragstream.connectors.folder import FolderConnector, FolderNotAllowed, confined_folder
from ragstream.connectors.registry import register_folder
from ragstream.jobs.progress import SyncProgress
from ragstream.storage.cursors import Direction
from ragstream.storage.documents import DocumentStore
from ragstream.storage.runs import RagDisabled, Run, RunInProgress, RunStatus, RunStore

__all__ = [
    "ConnectionSyncStatus",
    "FolderSyncRequest",
    "FolderSyncStatus",
    "LiveSync",
    "SyncError",
    "SyncRunView",
    "folder_syncs_router",
    "sync_counts",
    "sync_router",
]

SyncError = Annotated[
    str | None,
    Field(
        title="What went wrong",
        description="The latest failed sync's reason, then the documents that did not index by code, e.g. "
        "'3 documents failed: 2 embedding_unavailable, 1 binary'. None when all is well.",
    ),
]

StatusLabel = Literal["Queued", "Syncing", "Ready", "Failed", "Cancelled"]


# The counts of a sync's progress document that the view shows as they are.
_COUNT_NAMES = ("listed", "unchanged", "changed", "indexed", "deleted", "failed", "chunks", "skipped")


def sync_counts(progress: Mapping[str, Any]) -> dict[str, Any]:
    """A sync's counts from its run's progress document: zero before its first progress write."""
    return {
        **{name: progress.get(name, 0) for name in _COUNT_NAMES},
        "listing_done": progress.get("listing_done", False),
        "direction": progress.get("direction"),
        "resumed": progress.get("resumed", False),
    }


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
    def of(cls, run: Run) -> SyncRunView:
        counts = run.progress
        assert run.connection_id is not None, "a sync run has a connection"
        return cls(
            id=run.id,
            connection_id=run.connection_id,
            trigger=run.trigger,
            status=status_label(run.status),
            reason=run.error,
            **sync_counts(counts),
            rate=counts.get("rate"),
            eta_seconds=counts.get("eta_seconds"),
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
        RunStatus.RUNNING: "Syncing",
        RunStatus.SUCCEEDED: "Ready",
        RunStatus.FAILED: "Failed",
        RunStatus.CANCELLED: "Cancelled",
    }
    return labels[status]


def sync_router(runs: Callable[[], RunStore | None], on_enqueued: Callable[[], None] | None = None) -> APIRouter:
    """``runs`` is a getter because the app starts before the store is open (503 until then);
    ``on_enqueued`` tells the local runner to claim a new run now rather than at its next poll."""
    router = APIRouter(prefix="/v1/connections", tags=["syncs"])

    async def store_of(connection_id: str) -> RunStore:
        store = runs()
        if store is None:
            raise HTTPException(status_code=503, detail="the index is still starting")
        if await store.connections.get(connection_id) is None:
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
        except (RunInProgress, RagDisabled) as error:
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
            reason=latest.error,
            sync_error=sync_error,
            progress=SyncRunView.of(latest),
        )

    return router


class FolderSyncRequest(BaseModel):
    path: Annotated[
        str,
        Field(
            title="Folder to sync",
            description="An absolute path inside RAGSTREAM_FOLDER_ROOTS, or one of the folders the process "
            "syncs on its own (RAGSTREAM_FETCHER_FOLDERS, `ragstream up --source`).",
        ),
    ]


class FolderSyncStatus(BaseModel):
    connection_id: Annotated[str, Field(title="Connection id of the folder")]
    state: Annotated[
        Literal["syncing", "ready", "failed", "cancelled"],
        Field(title="The latest run", description="syncing while queued or running; ready: all of it searchable."),
    ]
    counts: Annotated[dict[str, Any], Field(title="The latest run's counts", description="As in SyncRunView.")]
    error: Annotated[str | None, Field(title="Why the latest run failed")] = None

    @classmethod
    def of(cls, run: Run) -> FolderSyncStatus:
        states: dict[RunStatus, Literal["syncing", "ready", "failed", "cancelled"]] = {
            RunStatus.SUCCEEDED: "ready",
            RunStatus.FAILED: "failed",
            RunStatus.CANCELLED: "cancelled",
        }
        assert run.connection_id is not None, "a sync run has a connection"
        return cls(
            connection_id=run.connection_id,
            state=states.get(run.status, "syncing"),
            counts=sync_counts(run.progress),
            error=run.error,
        )


class LiveSync(BaseModel):
    listed: Annotated[int, Field(title="Items listed at the origin so far")]
    unchanged: Annotated[int, Field(title="Listed items already indexed as they are")]
    changed: Annotated[int, Field(title="New or changed items announced")]
    indexed: Annotated[int, Field(title="Documents indexed")]
    deleted: Annotated[int, Field(title="Documents deleted")]
    failed_fetching: Annotated[int, Field(title="Documents that failed before they were announced")]
    failed_processing: Annotated[int, Field(title="Documents that failed in chunk, embed or index")]
    failed: Annotated[int, Field(title="Documents that failed")]
    done: Annotated[int, Field(title="Unchanged, indexed or failed")]
    chunks: Annotated[int, Field(title="Chunks committed")]
    skipped: Annotated[dict[str, int], Field(title="Entries left out of the listing, by reason")]
    listing_done: Annotated[bool, Field(title="The listing is complete", description="Until then listed grows.")]
    direction: Annotated[Direction | None, Field(title="Which walk: backward (first, full) or forward")] = None
    resumed: Annotated[bool, Field(title="Resumed an interrupted sync")] = False
    rate: Annotated[float, Field(title="Documents per second")]
    eta_seconds: Annotated[float | None, Field(title="Seconds left at the current rate")] = None

    @classmethod
    def of(cls, progress: SyncProgress) -> LiveSync:
        return cls(
            listed=progress.listed,
            unchanged=progress.unchanged,
            changed=progress.changed,
            indexed=progress.indexed,
            deleted=progress.deleted,
            failed_fetching=progress.failed_fetching,
            failed_processing=progress.failed_processing,
            failed=progress.failed,
            done=progress.done,
            chunks=progress.chunks,
            skipped=dict(progress.skipped),
            listing_done=progress.listing_done,
            direction=progress.direction,
            resumed=progress.resumed,
            rate=round(progress.rate, 2),
            eta_seconds=progress.eta_seconds,
        )


def folder_syncs_router(
    runs: RunStore,
    store: DocumentStore,
    live: Callable[[], Mapping[str, SyncProgress]],
    on_enqueued: Callable[[], None],
    *,
    folder_roots: Collection[Path],
    own_folders: Collection[Path] = (),
) -> APIRouter:
    """``/v1/syncs``: sync a folder named by its path (registered as a ``folder`` connection, then a
    queued run like any other, claimed by the runner that ``on_enqueued`` wakes), the latest run of a
    connection, and ``live``: the progress of this process's runs, as they move."""
    router = APIRouter(prefix="/v1/syncs", tags=["syncs"])

    def allowed(folder: Path) -> Path:
        """One of the process's own folders, or one inside the roots."""
        if folder.resolve() in {own.resolve() for own in own_folders}:
            return folder
        return confined_folder(folder, list(folder_roots))

    @router.get("", response_model=dict[str, LiveSync])
    async def live_syncs() -> dict[str, LiveSync]:
        """Progress of the latest sync this process ran of each connection: counts, rate and ETA."""
        return {connection: LiveSync.of(progress) for connection, progress in live().items()}

    @router.post(
        "",
        status_code=202,
        response_model=FolderSyncStatus,
        responses={
            409: {"description": "Sync already in progress"},
            422: {"description": "Not a folder the process may read"},
        },
    )
    async def sync_folder(request: FolderSyncRequest) -> FolderSyncStatus:
        """Queue a sync of a folder; follow it with ``GET /v1/syncs/{connection_id}``."""
        try:
            folder = await asyncio.to_thread(allowed, Path(request.path))
            FolderConnector(folder)
        except FolderNotAllowed as error:
            raise HTTPException(status_code=422, detail=str(error)) from None
        except NotADirectoryError:
            detail = f"{request.path} is not a folder this process can read"
            raise HTTPException(status_code=422, detail=detail) from None
        connection_id = await register_folder(store, folder)
        try:
            run = await runs.start(connection_id, "api")
        except (RunInProgress, RagDisabled) as error:
            raise HTTPException(status_code=409, detail=str(error)) from error
        on_enqueued()
        return FolderSyncStatus.of(run)

    @router.get("/{connection_id}", response_model=FolderSyncStatus, responses={404: {"description": "Never synced"}})
    async def latest_sync(connection_id: str) -> FolderSyncStatus:
        """The connection's latest run: ``syncing`` until every change it announced is searchable."""
        await runs.reap(connection_id)  # a run whose owner died shows failed, not syncing
        latest = await runs.latest(connection_id)
        if latest is None:
            raise HTTPException(status_code=404, detail="no sync of that connection")
        return FolderSyncStatus.of(latest)

    return router
