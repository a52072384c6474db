"""connector-fetcher service: an HTTP trigger, a timer and the scheduler that run syncs, publishing to Kafka.

The fetcher is the only stage with no input topic: a sync starts from ``POST /v1/syncs``, from the
periodic timer over ``RAGSTREAM_FETCHER_FOLDERS``, or from the scheduler (each connection's
``schedule_seconds``; one leader across replicas, every replica claims queued runs within
``RAGSTREAM_MAX_CONCURRENT_SYNCS``; off with ``RAGSTREAM_SCHEDULER_ENABLED=false``). It announces
every difference between the source listing and the committed state (acknowledged by Kafka).
``POST /v1/replays`` publishes failed documents (from the failures table or the dead-letter topic)
to ``doc.changed`` again.
Each sync is also a row in ``sync_runs``, so the database refuses a second sync of a connection from
any replica and ``ragstream status`` shows it. The run stays syncing after the announcements until
the indexer has committed (or a stage has given up on) every announced change: its indexed, failed
and chunk counts are the committed ones, and ready means searchable.
The fetch keeps its ``download`` cursor in PostgreSQL, so a fetcher killed mid-walk resumes it on the
next sync; the index side's cursors here are the consumer groups' committed offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Response
from prometheus_client import make_asgi_app
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragstream.api.auth import Access, protect
from ragstream.api.replays import ReplayRequest, ReplayResult, replay_router
from ragstream.connectors.base import Connector
from ragstream.connectors.folder import FolderConnector, FolderNotAllowed, confined_folder
from ragstream.connectors.registry import NoConnector, connector_for, register_folder
from ragstream.control.runner import RunExecution, RunProgress, failure_reason
from ragstream.control.runs import (
    CONNECTION_ERRORS,
    Downstream,
    RagDisabled,
    RunCounts,
    RunStatus,
    SyncInProgress,
    SyncRun,
    SyncRunStore,
    Trigger,
)
from ragstream.control.scheduler import Scheduler
from ragstream.credentials import CredentialCipher
from ragstream.kafka import KafkaChangeSink, create_broker, dead_letters, ensure_topics
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings
from ragstream.stages.fetch import FetchService, SyncCounts
from ragstream.stages.replay import ReplayService

__all__ = ["FetcherSettings", "create_app"]

logger = logging.getLogger(__name__)

# Seconds between looks for queued runs when nothing wakes the claimer earlier.
_CLAIM_POLL_S = 5.0


class FetcherSettings(BaseSettings):
    """What only the fetcher reads; everything shared comes from ``Settings``."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_FETCHER_")

    folders: Annotated[list[Path], Field(title="Folders synced on the timer")] = []
    interval_s: Annotated[float, Field(title="Seconds between timed syncs; 0 disables the timer", ge=0)] = 3600


class SyncRequest(BaseModel):
    path: Annotated[
        str,
        Field(
            title="Folder to sync",
            description="An absolute path inside RAGSTREAM_FOLDER_ROOTS, or one of RAGSTREAM_FETCHER_FOLDERS.",
        ),
    ]


class SyncStatus(BaseModel):
    connection_id: str
    state: Annotated[str, Field(title="syncing, ready or failed")]
    counts: dict[str, Any]
    error: str | None = None


def create_app() -> FastAPI:
    """Refuses to build without ``RAGSTREAM_API_KEYS`` unless ``RAGSTREAM_AUTH=none``."""
    settings = Settings()
    access = Access.for_service(settings, "connector-fetcher")
    fetcher = FetcherSettings()
    broker = create_broker(settings.kafka_bootstrap_servers, "connector-fetcher")
    state: dict[str, Runtime] = {}
    syncs: dict[str, SyncStatus] = {}
    running: dict[str, asyncio.Task[None]] = {}
    wake = asyncio.Event()  # a run was just enqueued: claim now rather than at the next poll
    # One per process: its session owns the runs this fetcher is executing (see SyncRunStore).
    stores: dict[str, SyncRunStore] = {}

    def run_store() -> SyncRunStore:
        return stores["runs"]

    def run_counts(
        counts: SyncCounts, downstream: Downstream | None = None, *, listing_done: bool = False
    ) -> RunCounts:
        later = downstream or Downstream(indexed=0, failed=0, chunks=0)
        return RunCounts(
            listed=counts.seen,
            unchanged=counts.unchanged,
            changed=counts.changed,
            indexed=later.indexed,
            deleted=counts.deleted,
            failed=counts.failed + later.failed,
            chunks=later.chunks,
            listing_done=listing_done,
            direction=counts.direction,
            resumed=counts.resumed,
            skipped=sum(counts.skipped.values()),
        )

    async def run_sync(connector: Connector, run: SyncRun) -> None:
        """One run through the shared ``RunExecution`` (progress writes, a run failed elsewhere
        stopping the walk, failed with a reason on any error or shutdown), as the embedded runner."""
        status = syncs[connector.connection_id]
        execution = RunExecution(run_store(), run, progress_interval_s=settings.sync_progress_interval_s)
        started = time.monotonic()

        def rate(counts: SyncCounts, downstream: Downstream | None = None) -> float:
            """Items done per second: listed while announcing, then unchanged plus indexed or failed."""
            done = counts.seen if downstream is None else counts.unchanged + downstream.indexed + downstream.failed
            return done / max(time.monotonic() - started, 1e-9)

        async def observe(counts: SyncCounts) -> None:
            status.counts = asdict(counts) | {"announced": len(counts.announced)}
            execution.progress = RunProgress(run_counts(counts), rate(counts))

        async def sync() -> tuple[SyncCounts, Downstream]:
            """Announce every difference, then wait until the indexer has committed (or a stage has
            given up on) each announced change, publishing the downstream counts meanwhile: the
            heartbeat moves only when they do, so a stalled pipeline goes stale."""
            service = FetchService(
                state["runtime"].store, connector, max_document_bytes=settings.max_document_bytes, on_item=observe
            )
            await service.register()
            counts = await service.run(KafkaChangeSink(broker))
            await observe(counts)
            runs = run_store()
            while not (downstream := await runs.downstream(counts.announced)).settled(len(counts.announced)):
                status.counts |= {"indexed": downstream.indexed, "failed_downstream": downstream.failed}
                done = downstream.indexed + downstream.failed
                eta = (len(counts.announced) - done) / (done / (time.monotonic() - started)) if done else None
                current = run_counts(counts, downstream, listing_done=True)
                execution.progress = RunProgress(current, rate(counts, downstream), eta)
                await asyncio.sleep(settings.sync_progress_interval_s)
            status.counts |= {"indexed": downstream.indexed, "failed_downstream": downstream.failed}
            return counts, downstream

        def final(done: tuple[SyncCounts, Downstream]) -> RunProgress:
            counts, downstream = done
            return RunProgress(run_counts(counts, downstream, listing_done=True), rate(counts, downstream))

        try:
            outcome = await execution.execute(sync(), final)
        finally:
            running.pop(connector.connection_id, None)
        ended, completed = outcome
        if completed is not None:
            status.state = "ready"
        else:
            row = ended or await run_store().get(run.id)
            status.state, status.error = "failed", row.reason if row is not None else "the run is gone"

    def check_requested(folder: Path) -> None:
        """A folder asked for over the API: one of the timed folders, or one inside the roots."""
        if folder.resolve() not in {timed.resolve() for timed in fetcher.folders}:
            confined_folder(folder, settings.folders.roots())

    async def start_sync(folder: Path, trigger: Trigger) -> SyncStatus:
        if trigger == "api":
            try:
                await asyncio.to_thread(check_requested, folder)
            except FolderNotAllowed as error:
                raise HTTPException(status_code=422, detail=str(error)) from None
        try:
            connector = FolderConnector(folder)
        except NotADirectoryError as error:
            raise HTTPException(status_code=422, detail=f"{folder} is not a folder the fetcher can read") from error
        runs = run_store()
        await register_folder(state["runtime"].store, folder)
        try:
            run = await runs.start(connector.connection_id, trigger, running=True)
        except (SyncInProgress, RagDisabled) as error:
            raise HTTPException(status_code=409, detail=str(error)) from error
        syncs[connector.connection_id] = SyncStatus(connection_id=connector.connection_id, state="syncing", counts={})
        running[connector.connection_id] = asyncio.create_task(run_sync(connector, run))
        return syncs[connector.connection_id]

    async def launch(run: SyncRun) -> None:
        """Run a claimed run of any connection the fetcher has a connector for. A run that cannot
        start (no connector, a folder gone, the database failing) ends failed at once: it is owned by
        this process, so left syncing it would block the connection until the stale timeout."""
        runs = run_store()
        try:
            row = await runs.connection(run.connection_id)
            if row is None:
                raise NoConnector(f"connection {run.connection_id} no longer exists")
            connector = connector_for(row)
        except Exception as error:
            logger.warning("sync run %s of %s cannot start", run.id, run.connection_id, exc_info=True)
            try:
                await runs.finish(run.id, RunStatus.FAILED, failure_reason(error), RunCounts(), None)
            finally:
                # If finish could not write, the run is left ownerless, and any reap fails it.
                await runs.release(run.id)
            return
        syncs[run.connection_id] = SyncStatus(connection_id=run.connection_id, state="syncing", counts={})
        running[run.connection_id] = asyncio.create_task(run_sync(connector, run))

    async def claim_queued() -> None:
        """Run the queued runs (enqueued by the scheduler leader of any replica) that a free slot
        allows; the concurrency limit holds across replicas because claims are serialised in the
        database."""
        while True:
            try:
                runs = run_store()
                await runs.reap()
                while (run := await runs.claim(settings.max_concurrent_syncs)) is not None:
                    await launch(run)
            except CONNECTION_ERRORS as error:
                logger.warning("claiming sync runs failed, retrying: %s", error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), _CLAIM_POLL_S)
            wake.clear()

    async def timer() -> None:
        while True:
            for folder in fetcher.folders:
                try:
                    await start_sync(folder, "schedule")
                except HTTPException as error:
                    logger.warning("timed sync of %s not started: %s", folder, error.detail)
            await asyncio.sleep(fetcher.interval_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not settings.database_url:
            raise RuntimeError("DATABASE_URL must be set for the connector-fetcher service")
        await ensure_topics(settings.kafka_bootstrap_servers)
        await broker.start()
        async with open_runtime(settings, settings.database_url) as runtime:
            state["runtime"] = runtime
            stores["runs"] = SyncRunStore(
                runtime.pool,
                runtime.dsn,
                stale_timeout_s=settings.sync_stale_timeout_s,
                cipher=CredentialCipher.from_settings(settings),
            )
            background = [asyncio.create_task(timer())] if fetcher.folders and fetcher.interval_s else []
            if settings.scheduler_enabled:
                # One leader across the fetcher replicas enqueues due connections; every replica claims.
                scheduler = Scheduler(
                    runtime.dsn, stores["runs"], interval_s=settings.scheduler_interval_s, on_enqueued=wake.set
                )
                background += [asyncio.create_task(scheduler.run()), asyncio.create_task(claim_queued())]
            try:
                yield
            finally:
                tasks = [*background, *running.values()]
                for task in tasks:
                    task.cancel()
                # Wait, so cancelled syncs are recorded as failed before the pool closes.
                await asyncio.gather(*tasks, return_exceptions=True)
                await stores.pop("runs").aclose()
                state.clear()
        await broker.stop()

    async def replay(request: ReplayRequest) -> ReplayResult:
        service, sink = ReplayService(state["runtime"].store), KafkaChangeSink(broker)
        if request.source == "dead-letter":
            letters = dead_letters(settings.kafka_bootstrap_servers)
            counts = await service.dead_letters(letters, sink, request.connection_id)
        else:
            counts = await service.failures(sink, request.connection_id)
        return ReplayResult(replayed=counts.replayed, needs_sync=counts.needs_sync, resolved=counts.resolved)

    app = FastAPI(title="ragstream connector-fetcher", version="1", lifespan=lifespan)
    protect(app, access, max_request_bytes=settings.max_request_bytes)
    app.mount("/metrics", make_asgi_app())
    app.include_router(replay_router(replay))

    @app.post("/v1/syncs", status_code=202, response_model=SyncStatus)
    async def create_sync(request: SyncRequest) -> SyncStatus:
        return await start_sync(Path(request.path), "api")

    @app.get("/v1/syncs/{connection_id}", response_model=SyncStatus)
    async def get_sync(connection_id: str) -> SyncStatus:
        if connection_id not in syncs:
            raise HTTPException(status_code=404, detail="no sync of that connection")
        return syncs[connection_id]

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict[str, str]:
        if "runtime" in state:
            return {"status": "ready"}
        response.status_code = 503
        return {"status": "starting"}

    return app
