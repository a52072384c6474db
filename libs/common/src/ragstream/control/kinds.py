"""The kinds of run the runner executes, each one function of a ``JobContext``: sync, re-index,
re-chunk and replay. A new kind (a crawl, a webhook batch) is one more such function, registered in
the mapping the runner is given (``run_kinds``) and named in ``runs.kind``'s check."""

from __future__ import annotations

from collections.abc import Callable

from ragstream.chunking import parse_chunking
from ragstream.connectors.registry import NoConnector, connector_for
from ragstream.control.runner import Job, JobContext
from ragstream.jobs.sync import SyncJob, SyncReport
from ragstream.rechunk import Rechunker, RechunkProgress
from ragstream.reindex import Reindexer, ReindexProgress
from ragstream.storage.runs import RunStore

__all__ = ["rechunk_kind", "reindex_kind", "run_kinds", "sync_kind"]


def sync_kind(runs: RunStore, job: Callable[[], SyncJob]) -> Job:
    """Sync the run's connection through the sync job (over the mode's transport)."""

    async def sync(context: JobContext) -> SyncReport:
        connection_id = context.run.connection_id
        row = await runs.connection(connection_id) if connection_id is not None else None
        if row is None:
            raise NoConnector(f"connection {connection_id} no longer exists")
        return await job().sync(connector_for(row), context.publish)

    return sync


def reindex_kind(reindexer: Reindexer) -> Job:
    """Re-index the run's connection (none: the deployment) into the model of ``params.spec``."""

    async def reindex(context: JobContext) -> ReindexProgress:
        run = context.run
        spec = run.params.get("spec")
        if run.connection_id is not None:
            return await reindexer.run_connection(run.id, run.connection_id, spec, context.publish)
        if spec is None:
            raise ValueError("a deployment-wide re-index needs a target model")
        return await reindexer.run(run.id, reindexer.target(spec), spec, context.publish)

    return reindex


def rechunk_kind(rechunker: Rechunker) -> Job:
    """Re-chunk the run's connection with ``params.chunking``."""

    async def rechunk(context: JobContext) -> RechunkProgress:
        run = context.run
        if run.connection_id is None:
            raise ValueError("a re-chunk needs a connection")
        chunking = parse_chunking(run.params["chunking"])
        return await rechunker.run(run.id, run.connection_id, chunking, context.publish)

    return rechunk


def run_kinds(runs: RunStore, job: Callable[[], SyncJob], reindexer: Reindexer, rechunker: Rechunker) -> dict[str, Job]:
    """Every kind a control-plane process runs (``ragstream up``, the connector-fetcher)."""
    return {
        "sync": sync_kind(runs, job),
        "reindex": reindex_kind(reindexer),
        "rechunk": rechunk_kind(rechunker),
    }
