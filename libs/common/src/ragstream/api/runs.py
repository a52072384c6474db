"""``/v1/runs``: every run of every kind (sync, re-index, re-chunk, replay), listed, read, and cancelled
from any replica; and the one shape of a kind's own routes (``kind_routes``): its latest run, and a
cancel of its active one. A start refused because one of its kind and scope is active
(``RunInProgress``) answers 409, one of a connection that is gone (``UnknownConnection``) 404, through
the API's error mapping."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, HTTPException, Query, status
from pydantic import BaseModel, Field

from ragstream.storage.runs import Run, RunKind, RunStore

__all__ = ["RunState", "RunView", "kind_routes", "run_fields", "runs_router"]

RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
_View = TypeVar("_View", bound=BaseModel)


class RunView(BaseModel):
    """A run of any kind as its row stores it."""

    id: Annotated[int, Field(title="Run id")]
    kind: Annotated[
        str, Field(title="Kind", description="sync, reindex, rechunk, replay, or another kind a runner registers.")
    ]
    connection_id: Annotated[str | None, Field(title="Connection", description="None: the deployment.")] = None
    trigger: Annotated[str, Field(title="What started it", description="api, create, schedule or cli.")]
    status: Annotated[RunState, Field(title="Run status")]
    params: Annotated[dict[str, Any], Field(title="What the job was given")]
    progress: Annotated[
        dict[str, Any],
        Field(
            title="Progress document",
            description="The kind's counts, then total, done, rate (items per second) and eta_seconds; "
            "written with the heartbeat every few seconds.",
        ),
    ]
    error: Annotated[str | None, Field(title="Why it failed or was cancelled")] = None
    cancel_requested: Annotated[bool, Field(title="A cancel was asked for")] = False
    owner: Annotated[str | None, Field(title="Process executing it (host:pid)")] = None
    created_at: Annotated[datetime, Field(title="Queued at")]
    started_at: Annotated[datetime | None, Field(title="Started at")] = None
    heartbeat_at: Annotated[datetime | None, Field(title="Last progress at")] = None
    finished_at: Annotated[datetime | None, Field(title="Finished at")] = None

    @classmethod
    def of(cls, run: Run) -> RunView:
        return cls.model_validate(run, from_attributes=True)


def run_fields(run: Run) -> dict[str, Any]:
    """What every kind's own status view takes from the run row as it is: its id, status, error,
    rate and ETA, and its times."""
    return {
        "id": run.id,
        "status": run.status.value,
        "error": run.error,
        "rate": run.progress.get("rate"),
        "eta_seconds": run.progress.get("eta_seconds"),
        "created_at": run.created_at,
        "started_at": run.started_at,
        "heartbeat_at": run.heartbeat_at,
        "finished_at": run.finished_at,
    }


def kind_routes(
    router: APIRouter,
    runs: RunStore,
    kind: RunKind,
    model: type[_View],
    view: Callable[[Run], _View],
    *,
    path: str,
    what: str,
    tags: list[str | Enum] | None = None,
) -> None:
    """On ``router``: ``GET path``, the latest run of ``kind`` of the path's ``connection_id`` (or of
    the deployment when the path has none), and ``DELETE path``, asking its active
    run to stop, whichever replica executes it (202). ``view`` shapes the run as ``model``; ``what``
    names the kind in answers."""

    def none_of(connection_id: str | None, which: str) -> HTTPException:
        whose = f" of connection {connection_id!r}" if connection_id else ""
        return HTTPException(status_code=404, detail=f"no {what}{whose} {which}")

    async def latest(connection_id: str | None) -> _View:
        run = await runs.latest(connection_id, kind=kind)
        if run is None:
            raise none_of(connection_id, "has run")
        return view(run)

    async def cancel(connection_id: str | None) -> _View:
        active = await runs.active(connection_id, kind=kind)
        if active is None:
            raise none_of(connection_id, "is queued or running")
        cancelled = await runs.request_cancel(active.id)
        return view(cancelled if cancelled is not None else active)

    not_found: dict[int | str, dict[str, Any]] = {404: {"description": f"No {what} of this scope"}}
    get_endpoint: Callable[..., Awaitable[Any]]
    delete_endpoint: Callable[..., Awaitable[Any]]
    if "{connection_id}" in path:

        async def connection_latest(connection_id: str) -> Any:
            return await latest(connection_id)

        async def connection_cancel(connection_id: str) -> Any:
            return await cancel(connection_id)

        get_endpoint, delete_endpoint = connection_latest, connection_cancel
    else:

        async def deployment_latest() -> Any:
            return await latest(None)

        async def deployment_cancel() -> Any:
            return await cancel(None)

        get_endpoint, delete_endpoint = deployment_latest, deployment_cancel
    get_endpoint.__doc__ = f"The latest {what}, from the database: any replica's, written every few seconds."
    delete_endpoint.__doc__ = (
        f"Ask the queued or running {what} to stop, whichever replica runs it: it ends cancelled within"
        " a heartbeat, what it replaces stays in use, and starting it again resumes."
    )
    router.add_api_route(path, get_endpoint, methods=["GET"], response_model=model, responses=not_found, tags=tags)
    router.add_api_route(
        path,
        delete_endpoint,
        methods=["DELETE"],
        response_model=model,
        status_code=status.HTTP_202_ACCEPTED,
        responses=not_found,
        tags=tags,
    )


def runs_router(runs: RunStore) -> APIRouter:
    """``/v1/runs``: list, read and cancel runs of every kind."""
    router = APIRouter(prefix="/v1/runs", tags=["runs"])
    not_found: dict[int | str, dict[str, Any]] = {404: {"description": "No such run"}}

    @router.get("", response_model=list[RunView])
    async def list_runs(
        kind: Annotated[str | None, Query(description="Only runs of this kind (sync, reindex, ...).")] = None,
        connection_id: Annotated[str | None, Query(description="Only runs of this connection.")] = None,
        limit: Annotated[int, Query(ge=1, le=100, description="Newest first.")] = 20,
    ) -> list[RunView]:
        """Runs newest first, of every kind unless ``kind`` is given."""
        return [RunView.of(run) for run in await runs.runs(connection_id, kind=kind, limit=limit)]

    @router.get("/{run_id}", response_model=RunView, responses=not_found)
    async def get_run(run_id: int) -> RunView:
        """A run with its progress document: counts, total, done, rate and ETA."""
        run = await runs.get(run_id)
        if run is None:
            raise HTTPException(status_code=404, detail=f"no run {run_id}")
        return RunView.of(run)

    @router.delete("/{run_id}", response_model=RunView, status_code=status.HTTP_202_ACCEPTED, responses=not_found)
    async def cancel_run(run_id: int) -> RunView:
        """Ask a run to stop, from any replica: a queued run is cancelled at once, a running one by
        its owner at its next heartbeat (``cancel_requested`` shows the request). A finished run is
        returned as it is."""
        run = await runs.request_cancel(run_id)
        if run is None:
            raise HTTPException(status_code=404, detail=f"no run {run_id}")
        return RunView.of(run)

    return router
