"""Runs claimed sync runs through a sync job (over either transport) and writes their progress back.

``ragstream up`` and the connector-fetcher both run this one runner: only the job's transport differs.

A run never stays ``syncing`` because of this process: every exception, and a shutdown, ends it
``failed`` with a reason. The heartbeat only moves when the counters move, so a sync that hangs
(a platform call that never answers) goes stale and another start can replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from ragstream.connectors.registry import NoConnector, connector_for
from ragstream.control.runs import CONNECTION_ERRORS, RunCounts, RunStatus, SyncRun, SyncRunStore
from ragstream.degradation import EmbeddingDegraded
from ragstream.jobs.progress import SyncProgress
from ragstream.jobs.sync import SyncJob, SyncReport

__all__ = ["RunExecution", "RunOutcome", "SyncRunner", "failure_reason"]

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

# How long a run whose database went away keeps trying to record how it ended, and how often.
_FINISH_PATIENCE_S = 120.0
_FINISH_RETRY_S = 1.0


def failure_reason(error: BaseException) -> str:
    """The reason stored on a failed run: our own errors say it all, others name their type."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, NoConnector | EmbeddingDegraded):
        return str(error)
    return f"{type(error).__name__}: {error}"[:2000]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a run ended: its final row (None if it was failed as stale meanwhile) and the job's
    report (None when the sync did not complete)."""

    run: SyncRun | None
    report: SyncReport | None


class RunExecution:
    """One claimed (syncing) run that this process executes, to ready or failed.

    The work publishes its latest ``progress``; every ``progress_interval_s`` it is written, the
    heartbeat moving only when the counts did (so a hung sync goes stale). A lost write is not worth
    failing the sync for. A write that finds the run no longer syncing (failed elsewhere as stale or
    ownerless, maybe replaced already) cancels the work, which must not go on moving the cursors a
    replacement resumes, and releases the run's owner lock. Every exception, and a shutdown, ends the
    run failed with a reason: the run never stays syncing because of this process."""

    def __init__(self, runs: SyncRunStore, run: SyncRun, *, progress_interval_s: float) -> None:
        self.run = run
        self.progress = SyncProgress()
        self._runs = runs
        self._interval_s = progress_interval_s
        self._abandoned = False

    async def execute(
        self, work: Coroutine[Any, Any, _Result], final: Callable[[_Result], SyncProgress]
    ) -> tuple[SyncRun | None, _Result | None]:
        """Run ``work`` as this run; ``final`` gives the progress of a run that completed. Returns the
        finished row (None when the run was failed elsewhere) and the work's result (None unless it
        completed)."""
        run = self.run
        try:
            task = asyncio.create_task(work)
            writer = asyncio.create_task(self._write_progress(task))
            try:
                result = await task
            except asyncio.CancelledError:
                if not self._abandoned:
                    raise
                logger.warning("sync run %s was failed elsewhere (stale or ownerless); stopped", run.id)
                await self._runs.release(run.id)
                return None, None
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
        except asyncio.CancelledError:
            with contextlib.suppress(*CONNECTION_ERRORS):  # the database is gone too: reap fails the run
                await self._runs.finish(
                    run.id,
                    RunStatus.FAILED,
                    "cancelled: the process stopped",
                    self.progress.run_counts(),
                    self.progress.rate,
                )
            raise
        except Exception as error:  # any failure ends the run failed, with its reason, never syncing
            logger.warning("sync run %s of %s failed", run.id, run.connection_id, exc_info=True)
            return await self._finish(RunStatus.FAILED, failure_reason(error), self.progress), None
        return await self._finish(RunStatus.READY, None, final(result)), result

    async def _finish(self, status: RunStatus, reason: str | None, progress: SyncProgress) -> SyncRun | None:
        """End the run; while the database is unreachable (it failed the sync, maybe, and is being
        restarted), try again for ``_FINISH_PATIENCE_S``. Then give up: the run's owner session is
        gone with the database, so the next reap fails it as ownerless."""
        deadline = asyncio.get_running_loop().time() + _FINISH_PATIENCE_S
        while True:
            try:
                return await self._runs.finish(self.run.id, status, reason, progress.run_counts(), progress.rate)
            except CONNECTION_ERRORS as error:
                if asyncio.get_running_loop().time() > deadline:
                    logger.warning("sync run %s not finished, the database stays unreachable: %s", self.run.id, error)
                    return None
                logger.info("sync run %s: finishing waits for the database: %s", self.run.id, error)
            await asyncio.sleep(_FINISH_RETRY_S)

    async def _write_progress(self, work: asyncio.Task[Any]) -> None:
        last = RunCounts()
        while True:
            await asyncio.sleep(self._interval_s)
            progress = self.progress
            counts = progress.run_counts()
            try:
                still_running = await self._runs.progress(
                    self.run.id, counts, progress.rate, progress.eta_seconds, moved=counts != last
                )
            except CONNECTION_ERRORS as error:
                # A lost progress write is not worth failing the sync for; the next one catches up.
                logger.warning("progress of sync run %s not written: %s", self.run.id, error)
                continue
            if not still_running:
                self._abandoned = True
                work.cancel()
                return
            last = counts


class SyncRunner:
    """Claims queued runs within ``max_concurrent`` (across replicas) and runs each to its end."""

    def __init__(
        self,
        runs: SyncRunStore,
        job: Callable[[], SyncJob],
        *,
        max_concurrent: int = 2,
        progress_interval_s: float = 2.0,
        poll_interval_s: float = 5.0,
    ) -> None:
        self.runs = runs
        self._job = job
        self._max_concurrent = max_concurrent
        self._progress_interval_s = progress_interval_s
        self._poll_interval_s = poll_interval_s
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[RunOutcome]] = set()
        # The latest progress per connection: the live view of GET /v1/syncs.
        self.live: dict[str, SyncProgress] = {}

    def wake(self) -> None:
        """Look for queued runs now instead of at the next poll (a run was just enqueued)."""
        self._wake.set()

    async def serve(self) -> None:
        """Claim and run queued runs until cancelled; running ones are then failed as cancelled."""
        try:
            while True:
                try:
                    await self.claim_pending()
                except CONNECTION_ERRORS as error:
                    logger.warning("claiming sync runs failed, retrying: %s", error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll_interval_s)
                self._wake.clear()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def claim_pending(self) -> list[asyncio.Task[RunOutcome]]:
        """Fail runs whose owner is gone or that went stale, then start every queued run a free slot
        allows, each in its own task."""
        await self.runs.reap()
        started = []
        while (run := await self.runs.claim(self._max_concurrent)) is not None:
            task = asyncio.create_task(self.execute(run))
            self._tasks.add(task)
            task.add_done_callback(self._finished)
            started.append(task)
        return started

    def _finished(self, task: asyncio.Task[RunOutcome]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("sync run task failed", exc_info=error)
        self.wake()  # a slot is free

    async def execute(self, run: SyncRun, observe: Callable[[SyncProgress], None] | None = None) -> RunOutcome:
        """Run one claimed (syncing) run to ready or failed; ``observe`` also sees every update."""
        execution = RunExecution(self.runs, run, progress_interval_s=self._progress_interval_s)

        def notify(progress: SyncProgress) -> None:
            execution.progress = progress
            self.live[run.connection_id] = progress
            if observe is not None:
                observe(progress)

        async def sync() -> SyncReport:
            row = await self.runs.connection(run.connection_id)
            if row is None:
                raise NoConnector(f"connection {run.connection_id} no longer exists")
            return await self._job().sync(connector_for(row), notify)

        def final(report: SyncReport) -> SyncProgress:
            return report.progress

        return RunOutcome(*await execution.execute(sync(), final))
