"""The kinds of run the runner executes, each one function of a ``JobContext``: sync, re-index,
re-chunk and replay. A new kind (a crawl, a webhook batch) is one more such function, registered in
the mapping the runner is given (``run_kinds``) and named in ``RunKind`` for the API's schema."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Callable

from ragstream.chunking import parse_chunking
from ragstream.connectors.registry import ConnectionRow, NoConnector, connector_for
from ragstream.control.runner import Job, JobContext
from ragstream.jobs.progress import ReplayProgress, SyncProgress
from ragstream.jobs.sync import SyncJob, SyncReport
from ragstream.messages import DeadLetter
from ragstream.rechunk import Rechunker, RechunkProgress
from ragstream.reindex import Reindexer, ReindexProgress
from ragstream.stages.fetch import ChangeSink
from ragstream.stages.replay import ReplayCounts, ReplayService
from ragstream.storage.documents import DocumentStore
from ragstream.storage.runs import RunStore

__all__ = [
    "DEAD_LETTER",
    "FAILURES",
    "pipeline_replay_kind",
    "rechunk_kind",
    "reindex_kind",
    "run_kinds",
    "sync_kind",
    "topic_replay_kind",
]

# What a replay re-drives (``params.source``): the failures table (every mode) or the dead-letter
# topic (distributed mode only).
FAILURES = "failures"
DEAD_LETTER = "dead-letter"


def sync_kind(runs: RunStore, job: Callable[[], SyncJob]) -> Job:
    """Sync the run's connection through the sync job (over the mode's transport)."""

    async def sync(context: JobContext) -> SyncReport:
        connection_id = context.run.connection_id
        found = await runs.connections.get(connection_id) if connection_id is not None else None
        if found is None:
            raise NoConnector(f"connection {connection_id} no longer exists")
        credentials = await runs.connections.credentials(found.id)
        row = ConnectionRow(found.id, found.platform, found.name, found.config, credentials or {})
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


def pipeline_replay_kind(job: Callable[[], SyncJob]) -> Job:
    """Embedded mode: re-drive the failures (of the run's connection, or all) through the pipeline,
    and wait until they have indexed or failed again."""

    async def replay(context: JobContext) -> ReplayProgress:
        run, started = context.run, time.monotonic()
        if run.params.get("source", FAILURES) != FAILURES:
            raise ValueError("embedded mode has no dead-letter topic: replay failures")

        def settling(progress: SyncProgress) -> None:
            """The replay's own document while it settles, as in the Kafka mode's."""
            done = progress.indexed + progress.failed_processing
            context.publish(
                ReplayProgress(
                    started_at=started,
                    replayed=max(progress.changed, done),
                    indexed=progress.indexed,
                    failed_again=progress.failed_processing,
                )
            )

        counts, settled = await job().replay(run.connection_id, settling)
        final = ReplayProgress(
            started_at=started,
            replayed=counts.replayed,
            needs_sync=counts.needs_sync,
            resolved=counts.resolved,
            indexed=settled.indexed,
            failed_again=settled.failed,
        )
        context.publish(final)
        return final

    return replay


def topic_replay_kind(
    store: DocumentStore, sink: ChangeSink, letters: Callable[[], AsyncIterable[DeadLetter]] | None = None
) -> Job:
    """Distributed mode: publish the failures, or the dead ``letters`` (``params.source``), to
    ``doc.changed`` again through ``sink``; the stage services take it from there."""

    async def replay(context: JobContext) -> ReplayProgress:
        run, service, started = context.run, ReplayService(store), time.monotonic()

        def progress(counts: ReplayCounts) -> ReplayProgress:
            return ReplayProgress(
                started_at=started, replayed=counts.replayed, needs_sync=counts.needs_sync, resolved=counts.resolved
            )

        def replayed(counts: ReplayCounts) -> None:
            context.publish(progress(counts))

        if run.params.get("source", FAILURES) == DEAD_LETTER:
            if letters is None:
                raise ValueError("no dead-letter topic to read here: replay failures")
            counts = await service.dead_letters(letters(), sink, run.connection_id, replayed)
        else:
            counts = await service.failures(sink, run.connection_id, replayed)
        final = progress(counts)
        context.publish(final)
        return final

    return replay


def run_kinds(
    runs: RunStore, job: Callable[[], SyncJob], reindexer: Reindexer, rechunker: Rechunker, replay: Job
) -> dict[str, Job]:
    """Every kind a control-plane process runs (``ragstream up``, the connector-fetcher); only the
    sync job's transport and the ``replay`` kind differ by mode."""
    return {
        "sync": sync_kind(runs, job),
        "reindex": reindex_kind(reindexer),
        "rechunk": rechunk_kind(rechunker),
        "replay": replay,
    }
