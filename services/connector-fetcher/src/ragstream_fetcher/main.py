"""connector-fetcher service: an HTTP trigger and a timer that run syncs, publishing to Kafka.

The fetcher is the only stage with no input topic: a sync starts from ``POST /v1/syncs`` or from
the periodic timer over ``RAGSTREAM_FETCHER_FOLDERS``, and ends once every difference between
the source listing and the committed state has been published (and acknowledged by Kafka).
``POST /v1/replays`` publishes failed documents (from the failures table or the dead-letter topic)
to ``doc.changed`` again.
Each sync is also a row in ``sync_runs`` with the fetch stage's counts, so the database refuses a
second sync of a connection from any replica and ``ragstream status`` shows it; its status is the
fetch stage's (ready: everything announced; indexing goes on downstream).
The fetch keeps its ``download`` cursor in PostgreSQL, so a fetcher killed mid-walk resumes it on the
next sync; the index side's cursors here are the consumer groups' committed offsets.
"""

from __future__ import annotations

import asyncio
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

from ragstream.api.replays import ReplayRequest, ReplayResult, replay_router
from ragstream.connectors.folder import FolderConnector
from ragstream.connectors.registry import register_folder
from ragstream.control.runner import failure_reason
from ragstream.control.runs import RagDisabled, RunCounts, RunStatus, SyncInProgress, SyncRun, SyncRunStore, Trigger
from ragstream.kafka import KafkaChangeSink, create_broker, dead_letters, ensure_topics
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings
from ragstream.stages.fetch import FetchService, SyncCounts
from ragstream.stages.replay import ReplayService

__all__ = ["FetcherSettings", "create_app"]

logger = logging.getLogger(__name__)


class FetcherSettings(BaseSettings):
    """What only the fetcher reads; everything shared comes from ``Settings``."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_FETCHER_")

    folders: Annotated[list[Path], Field(title="Folders synced on the timer")] = []
    interval_s: Annotated[float, Field(title="Seconds between timed syncs; 0 disables the timer", ge=0)] = 3600


class SyncRequest(BaseModel):
    path: Annotated[str, Field(title="Folder to sync", description="A path the fetcher can read.")]


class SyncStatus(BaseModel):
    connection_id: str
    state: Annotated[str, Field(title="syncing, ready or failed")]
    counts: dict[str, Any]
    error: str | None = None


def create_app() -> FastAPI:
    settings = Settings()
    fetcher = FetcherSettings()
    broker = create_broker(settings.kafka_bootstrap_servers, "connector-fetcher")
    state: dict[str, Runtime] = {}
    syncs: dict[str, SyncStatus] = {}
    running: dict[str, asyncio.Task[None]] = {}

    def run_store() -> SyncRunStore:
        return SyncRunStore(state["runtime"].pool, stale_timeout_s=settings.sync_stale_timeout_s)

    def run_counts(counts: SyncCounts, *, listing_done: bool = False) -> RunCounts:
        return RunCounts(
            listed=counts.seen,
            unchanged=counts.unchanged,
            changed=counts.changed,
            deleted=counts.deleted,
            failed=counts.failed,
            listing_done=listing_done,
            direction=counts.direction,
            resumed=counts.resumed,
        )

    async def run_sync(connector: FolderConnector, run: SyncRun) -> None:
        status = syncs[connector.connection_id]
        runs = run_store()
        started = last_write = time.monotonic()
        latest = SyncCounts()

        def rate(counts: SyncCounts) -> float:
            return counts.seen / max(time.monotonic() - started, 1e-9)

        async def observe(counts: SyncCounts) -> None:
            nonlocal last_write, latest
            latest = counts
            status.counts = asdict(counts) | {"changed_ids": len(counts.changed_ids)}
            # Throttled like the embedded runner; every write here means the listing moved.
            if time.monotonic() - last_write >= settings.sync_progress_interval_s:
                await runs.progress(run.id, run_counts(counts), rate(counts), None, moved=True)
                last_write = time.monotonic()

        try:
            service = FetchService(
                state["runtime"].store, connector, max_document_bytes=settings.max_document_bytes, on_item=observe
            )
            await service.register()
            counts = await service.run(KafkaChangeSink(broker))
            await observe(counts)
            await runs.finish(run.id, RunStatus.READY, None, run_counts(counts, listing_done=True), rate(counts))
            status.state = "ready"
        except asyncio.CancelledError:
            await runs.finish(run.id, RunStatus.FAILED, "cancelled: the process stopped", run_counts(latest), None)
            raise
        except Exception as error:
            status.state, status.error = "failed", failure_reason(error)
            await runs.finish(run.id, RunStatus.FAILED, status.error, run_counts(latest), None)
            raise
        finally:
            running.pop(connector.connection_id, None)

    async def start_sync(folder: Path, trigger: Trigger) -> SyncStatus:
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
            ticking = asyncio.create_task(timer()) if fetcher.folders and fetcher.interval_s else None
            try:
                yield
            finally:
                tasks = [*running.values(), *([ticking] if ticking else [])]
                for task in tasks:
                    task.cancel()
                # Wait, so cancelled syncs are recorded as failed before the pool closes.
                await asyncio.gather(*tasks, return_exceptions=True)
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
