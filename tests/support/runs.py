"""Runs for tests: a runner that knows only the sync kind, and one job run as a foreground run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg

from ragstream.control.kinds import sync_kind
from ragstream.control.runner import Job, JobContext, Runner, RunOutcome
from ragstream.embedding.base import Embedder
from ragstream.jobs.progress import RunProgress
from ragstream.jobs.sync import SyncJob
from ragstream.reindex import Reindexer, ReindexProgress
from ragstream.storage.runs import RunKind, RunStore

__all__ = ["in_foreground", "reindex_job", "sync_runner"]


def sync_runner(runs: RunStore, job: Callable[[], SyncJob], **options: Any) -> Runner:
    """``Runner`` with the one kind ``sync``, running ``job`` (options as for ``Runner``)."""
    return Runner(runs, {"sync": sync_kind(runs, job)}, **options)


def reindex_job(reindexer: Reindexer, target: Embedder, spec: dict[str, Any]) -> Job:
    """A deployment-wide re-index into ``target`` (a test's embedder rather than one built from ``spec``)."""

    async def reindex(context: JobContext) -> ReindexProgress:
        return await reindexer.run(context.run.id, target, spec, context.publish)

    return reindex


async def in_foreground(
    pool: asyncpg.Pool,
    dsn: str,
    kind: RunKind,
    connection_id: str | None,
    params: dict[str, Any],
    job: Job,
    *,
    progress_interval_s: float = 2.0,
    observe: Callable[[RunProgress], None] | None = None,
) -> RunOutcome:
    """Run ``job`` as a run of ``kind`` this process owns, to its end, as ``ragstream reindex`` does."""
    runs = RunStore(pool, dsn)
    try:
        run = await runs.start(connection_id, "cli", kind=kind, params=params, running=True)
        return await Runner(runs, {kind: job}, progress_interval_s=progress_interval_s).execute(run, observe)
    finally:
        await runs.aclose()
