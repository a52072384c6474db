"""``POST /v1/replays``: re-drive failed documents as a ``replay`` run of this process, in whichever
mode it runs; the answer waits for the run's end (embedded mode: until the documents indexed or
failed again)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from ragstream.control.runner import Runner
from ragstream.jobs.progress import ReplayProgress
from ragstream.storage.runs import RunStore

__all__ = ["ReplayRequest", "ReplayResult", "replay_router"]


class ReplayRequest(BaseModel):
    connection_id: Annotated[str | None, Field(title="Only this connection's failures; all when unset")] = None
    source: Annotated[
        Literal["failures", "dead-letter"],
        Field(
            title="What to re-drive",
            description="`failures`: the failures table (every mode). `dead-letter`: the doc.dead-letter topic "
            "(distributed mode only).",
        ),
    ] = "failures"


class ReplayResult(BaseModel):
    run_id: Annotated[int | None, Field(title="The replay run", description="In /v1/runs, kind replay.")] = None
    replayed: Annotated[int, Field(title="Documents re-driven")]
    needs_sync: Annotated[int, Field(title="Failed before their content was staged: the next sync fetches them")]
    resolved: Annotated[int, Field(title="Dead letters whose document has indexed, been deleted or changed since")]
    indexed: Annotated[int | None, Field(title="Re-driven and indexed (embedded mode, which waits)")] = None
    failed_again: Annotated[int | None, Field(title="Re-driven and failed again (embedded mode)")] = None


def replay_router(runs: RunStore, runner: Runner, sources: Collection[str]) -> APIRouter:
    """Replays run on ``runner`` in this process; ``sources`` are those this mode can re-drive."""
    router = APIRouter()

    @router.post(
        "/v1/replays",
        response_model=ReplayResult,
        responses={
            404: {"description": "No such connection"},
            409: {"description": "A replay of this scope is running, or this one was cancelled"},
            422: {"description": "A source this mode cannot re-drive"},
        },
    )
    async def create_replay(request: ReplayRequest) -> ReplayResult:
        """Re-drive failed documents from their staged content; each keeps its version, so a replay
        racing a newer sync never overwrites it."""
        if request.source not in sources:
            raise HTTPException(status_code=422, detail=f"this mode has no {request.source} to replay: replay failures")
        params = {"source": request.source}
        run = await runs.start(request.connection_id, "api", kind="replay", params=params, running=True)
        outcome = await runner.execute(run)
        replayed = outcome.result
        if outcome.error is not None:
            raise outcome.error  # answered by the API's error mapping (a database outage: 503), never its text
        if not isinstance(replayed, ReplayProgress):
            ended = outcome.run.status.value if outcome.run is not None else "failed elsewhere"
            raise HTTPException(status_code=409, detail=f"replay run {run.id} did not complete: {ended}")
        return ReplayResult(
            run_id=run.id,
            replayed=replayed.replayed,
            needs_sync=replayed.needs_sync,
            resolved=replayed.resolved,
            indexed=replayed.indexed,
            failed_again=replayed.failed_again,
        )

    return router
