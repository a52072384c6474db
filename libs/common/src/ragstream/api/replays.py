"""``POST /v1/replays``: re-drive failed documents, in whichever mode the process runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

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
    replayed: Annotated[int, Field(title="Documents re-driven")]
    needs_sync: Annotated[int, Field(title="Failed before their content was staged: the next sync fetches them")]
    resolved: Annotated[int, Field(title="Dead letters whose document has indexed, been deleted or changed since")]
    indexed: Annotated[int | None, Field(title="Re-driven and indexed (embedded mode, which waits)")] = None
    failed_again: Annotated[int | None, Field(title="Re-driven and failed again (embedded mode)")] = None


def replay_router(replay: Callable[[ReplayRequest], Awaitable[ReplayResult]]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/replays", response_model=ReplayResult)
    async def create_replay(request: ReplayRequest) -> ReplayResult:
        """Re-drive failed documents from their staged content; each keeps its version, so a replay
        racing a newer sync never overwrites it."""
        return await replay(request)

    return router
