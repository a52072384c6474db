"""The knowledge tool as the control plane serves it: with writes, each starting its connection's sync."""

from __future__ import annotations

from collections.abc import Callable

from ragstream.control.runner import Runner
from ragstream.knowledge.models import IndexingState
from ragstream.knowledge.service import KnowledgeService, Searcher
from ragstream.runtime import Runtime
from ragstream.storage.runs import RagDisabled, RunInProgress, RunStore

__all__ = ["writing_knowledge"]


def writing_knowledge(
    runtime: Runtime, runs: RunStore, runner: Runner, searcher: Callable[[], Searcher | None]
) -> KnowledgeService:
    """A document written to a RAG connection starts a sync run of it (``runs``, claimed by ``runner``)."""

    async def sync_written(connection_id: str) -> IndexingState:
        """Only the changed document is downloaded again; if a sync is running, its successor (the
        next one started) picks it up."""
        try:
            await runs.start(connection_id, "api")
        except RunInProgress:
            return "sync_running"
        except RagDisabled:  # switched off meanwhile: searched live
            return "live"
        runner.wake()
        return "sync_started"

    return runtime.knowledge(searcher, on_written=sync_written)
