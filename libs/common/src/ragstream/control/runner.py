"""The one runner of every kind of run: claims queued runs, executes each through its kind's job, and
writes its progress back with the heartbeat.

``ragstream up`` and the connector-fetcher both run this runner with the same kinds (``control.kinds``):
only a sync job's transport and a replay's source differ by mode. A kind is one async function of a
``JobContext`` in the registry the runner is given: adding a kind is that function and its entry.

A run never stays ``running`` because of this process: every exception, and a shutdown, ends it
``failed`` with a reason. The heartbeat only moves when the counts move, so a job that hangs (a
platform call that never answers) goes stale and another start can replace it. A cancel asked for
by any process (``RunStore.request_cancel``) is seen at the next heartbeat: the job's task is
cancelled and the run ends ``cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from ragstream.connectors.registry import NoConnector
from ragstream.degradation import EmbeddingDegraded
from ragstream.jobs.progress import RunProgress, SyncProgress
from ragstream.logs import log_context
from ragstream.metrics import RUNS_FINISHED
from ragstream.storage.runs import CONNECTION_ERRORS, Run, RunStatus, RunStore

__all__ = [
    "CANCELLED_ON_REQUEST",
    "PROCESS_STOPPED",
    "Job",
    "JobContext",
    "RunExecution",
    "RunOutcome",
    "Runner",
    "failure_reason",
]

logger = logging.getLogger(__name__)

CANCELLED_ON_REQUEST = "cancelled on request"
PROCESS_STOPPED = "cancelled: the process stopped"
# How long a run whose database went away keeps trying to record how it ended, and how often.
_FINISH_PATIENCE_S = 120.0
_FINISH_RETRY_S = 1.0
# Of a progress document, what moves the heartbeat: the counts, not the rate and ETA the clock moves.
_CLOCK_FIELDS = frozenset({"rate", "eta_seconds"})


def failure_reason(error: BaseException) -> str:
    """The reason stored on a failed run: our own errors say it all, others name their type."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, NoConnector | EmbeddingDegraded):
        return str(error)
    return f"{type(error).__name__}: {error}"[:2000]


class JobContext:
    """What a job sees of its run: the row (``params`` has what it needs) and ``publish`` for its
    progress, written to the row at the next heartbeat."""

    def __init__(self, run: Run, observe: Callable[[RunProgress], None]) -> None:
        self.run = run
        self.progress: RunProgress | None = None
        self._observe = observe

    def publish(self, progress: RunProgress) -> None:
        self.progress = progress
        self._observe(progress)

    def document(self) -> dict[str, Any]:
        """The progress document to write: the latest published, else the row's own."""
        return self.progress.document() if self.progress is not None else dict(self.run.progress)


# A kind: runs the job of a claimed run to its end and returns what the caller may want (a sync's
# report); raising fails the run with the error as its reason.
Job = Callable[[JobContext], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a run ended: its final row (None if it was failed as stale meanwhile), the job's result
    (None when the job did not complete) and, when the job failed, what it raised (for a caller that
    answers in the request, such as a replay)."""

    run: Run | None
    result: object | None
    error: Exception | None = None


class RunExecution:
    """One claimed (running) run that this process executes, to succeeded, failed or cancelled.

    Every ``progress_interval_s`` the job's latest progress is written, the heartbeat moving only
    when the counts did (so a hung job goes stale). A lost write is not worth failing the run for. A
    write that finds the run no longer running (failed elsewhere as stale or ownerless, maybe
    replaced already) cancels the job, which must not go on moving what a replacement resumes, and
    releases the run's owner lock; one that finds a cancel requested cancels the job and ends the run
    cancelled. Every exception, and a shutdown, ends the run failed with a reason."""

    def __init__(self, runs: RunStore, context: JobContext, *, progress_interval_s: float) -> None:
        self.context = context
        self._runs = runs
        self._interval_s = progress_interval_s
        self._abandoned = False
        self._cancel_requested = False

    async def execute(self, work: Coroutine[Any, Any, object]) -> RunOutcome:
        run = self.context.run
        try:
            task = asyncio.create_task(work)
            writer = asyncio.create_task(self._write_progress(task))
            try:
                result = await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
                if self._abandoned:
                    logger.warning("%s run %s was failed elsewhere (stale or ownerless); stopped", run.kind, run.id)
                    await self._runs.release(run.id)
                    return RunOutcome(None, None)
                if not self._cancel_requested:
                    raise
                logger.info("%s run %s cancelled on request", run.kind, run.id)
                return RunOutcome(await self._finish(RunStatus.CANCELLED, CANCELLED_ON_REQUEST), None)
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
        except asyncio.CancelledError:
            with contextlib.suppress(*CONNECTION_ERRORS):  # the database is gone too: reap fails the run
                if await self._runs.finish(run.id, RunStatus.FAILED, PROCESS_STOPPED, self.context.document()):
                    RUNS_FINISHED.labels(run.kind, RunStatus.FAILED.value).inc()
            raise
        except Exception as error:  # any failure ends the run failed, with its reason, never running
            logger.warning("%s run %s of %s failed", run.kind, run.id, run.connection_id, exc_info=True)
            return RunOutcome(await self._finish(RunStatus.FAILED, failure_reason(error)), None, error)
        return RunOutcome(await self._finish(RunStatus.SUCCEEDED, None), result)

    async def _finish(self, status: RunStatus, reason: str | None) -> Run | None:
        """End the run; while the database is unreachable (it failed the job, maybe, and is being
        restarted), try again for ``_FINISH_PATIENCE_S``. Then give up: the run's owner session is
        gone with the database, so the next reap fails it as ownerless."""
        run_id = self.context.run.id
        deadline = asyncio.get_running_loop().time() + _FINISH_PATIENCE_S
        while True:
            try:
                finished = await self._runs.finish(run_id, status, reason, self.context.document())
                if finished is not None:  # None: ended elsewhere already (reaped as stale or ownerless)
                    RUNS_FINISHED.labels(self.context.run.kind, status.value).inc()
                return finished
            except CONNECTION_ERRORS as error:
                if asyncio.get_running_loop().time() > deadline:
                    logger.warning("run %s not finished, the database stays unreachable: %s", run_id, error)
                    return None
                logger.info("run %s: finishing waits for the database: %s", run_id, error)
            await asyncio.sleep(_FINISH_RETRY_S)

    async def _write_progress(self, work: asyncio.Task[Any]) -> None:
        run_id = self.context.run.id
        last = _counts(self.context.document())
        while True:
            await asyncio.sleep(self._interval_s)
            document = self.context.document()
            counts = _counts(document)
            try:
                beat = await self._runs.progress(run_id, document, moved=counts != last)
            except CONNECTION_ERRORS as error:
                # A lost progress write is not worth failing the run for; the next one catches up.
                logger.warning("progress of run %s not written: %s", run_id, error)
                continue
            if not beat.running or beat.cancel_requested:
                self._abandoned = not beat.running
                self._cancel_requested = beat.cancel_requested
                work.cancel()
                return
            last = counts


def _counts(document: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in document.items() if name not in _CLOCK_FIELDS}


class Runner:
    """Claims queued runs of the kinds it knows, within ``max_concurrent`` per kind (across
    replicas), and runs each to its end."""

    def __init__(
        self,
        runs: RunStore,
        kinds: Mapping[str, Job],
        *,
        max_concurrent: int = 2,
        progress_interval_s: float = 2.0,
        poll_interval_s: float = 5.0,
    ) -> None:
        self.runs = runs
        self.kinds = dict(kinds)
        self._max_concurrent = max_concurrent
        self._progress_interval_s = progress_interval_s
        self._poll_interval_s = poll_interval_s
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[RunOutcome]] = set()
        # The latest progress of each kind and scope run here: the live view of GET /v1/syncs.
        self.live: dict[tuple[str, str | None], RunProgress] = {}

    def wake(self) -> None:
        """Look for queued runs now instead of at the next poll (a run was just enqueued)."""
        self._wake.set()

    def live_syncs(self) -> dict[str, SyncProgress]:
        """The latest progress of each connection's sync run here."""
        return {
            connection_id: progress
            for (kind, connection_id), progress in self.live.items()
            if kind == "sync" and connection_id is not None and isinstance(progress, SyncProgress)
        }

    async def serve(self) -> None:
        """Claim and run queued runs until cancelled; running ones are then failed as cancelled."""
        try:
            while True:
                try:
                    await self.claim_pending()
                except CONNECTION_ERRORS as error:
                    logger.warning("claiming runs failed, retrying: %s", error)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_interval_s):
                        await self._wake.wait()
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
        while (run := await self.runs.claim(self._max_concurrent, self.kinds)) is not None:
            task = asyncio.create_task(self.execute(run))
            self._tasks.add(task)
            task.add_done_callback(self._finished)
            started.append(task)
        return started

    def _finished(self, task: asyncio.Task[RunOutcome]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("run task failed", exc_info=error)
        self.wake()  # a slot is free

    async def execute(self, run: Run, observe: Callable[[RunProgress], None] | None = None) -> RunOutcome:
        """Run one claimed (running) run to its end; ``observe`` also sees every progress update."""

        def notify(progress: RunProgress) -> None:
            self.live[run.kind, run.connection_id] = progress
            if observe is not None:
                observe(progress)

        context = JobContext(run, notify)
        execution = RunExecution(self.runs, context, progress_interval_s=self._progress_interval_s)
        job = self.kinds.get(run.kind)
        with log_context(connection_id=run.connection_id, run_id=str(run.id)):
            if job is None:
                return await execution.execute(_unknown_kind(run.kind))
            return await execution.execute(_call(job, context))


async def _call(job: Job, context: JobContext) -> object:
    return await job(context)


async def _unknown_kind(kind: str) -> object:
    raise LookupError(f"this process runs no {kind} jobs")
