"""The kinds of run the runner executes, each one function of a ``JobContext``: sync, re-index,
re-chunk and replay. A new kind (a crawl, a webhook batch) is one more such function, registered in
the mapping the runner is given (``run_kinds``) and named in ``runs.kind``'s check."""

from __future__ import annotations

from collections.abc import Callable

from ragstream.connectors.registry import NoConnector, connector_for
from ragstream.control.runner import Job, JobContext
from ragstream.jobs.sync import SyncJob, SyncReport
from ragstream.storage.runs import RunStore

__all__ = ["sync_kind"]


def sync_kind(runs: RunStore, job: Callable[[], SyncJob]) -> Job:
    """Sync the run's connection through the sync job (over the mode's transport)."""

    async def sync(context: JobContext) -> SyncReport:
        connection_id = context.run.connection_id
        row = await runs.connection(connection_id) if connection_id is not None else None
        if row is None:
            raise NoConnector(f"connection {connection_id} no longer exists")
        return await job().sync(connector_for(row), context.publish)

    return sync
