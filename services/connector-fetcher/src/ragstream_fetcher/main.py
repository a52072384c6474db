"""connector-fetcher service: the control plane of the distributed mode, its syncs published to Kafka.

It serves the same control-plane routers as ``ragstream up`` (connections, syncs and status,
re-chunk, re-index, replays, document reads; search is the retriever's) and runs the same sync runner:
every run (from the API, the scheduler or the timer over ``RAGSTREAM_FETCHER_FOLDERS``) is claimed
within ``RAGSTREAM_MAX_CONCURRENT_SYNCS`` across replicas and executed by the sync job over the Kafka
transport. A run stays syncing until the indexer has committed (or a stage has given up on) every
change it announced, so ready means searchable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI
from faststream.kafka import KafkaBroker
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragstream.api.auth import Access
from ragstream.api.control_plane import control_plane_routers, writing_knowledge
from ragstream.api.http import create_app as create_http_app
from ragstream.api.knowledge import knowledge_router
from ragstream.connectors.registry import register_folder
from ragstream.control.kinds import DEAD_LETTER, FAILURES, run_kinds, topic_replay_kind
from ragstream.control.runner import Runner
from ragstream.control.scheduler import Scheduler
from ragstream.credentials import CredentialCipher
from ragstream.jobs.sync import SyncJob
from ragstream.kafka import KafkaChangeSink, create_broker, dead_letters, ensure_topics
from ragstream.logs import configure_logging
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings
from ragstream.storage.database import ping
from ragstream.storage.downstream import DownstreamStore
from ragstream.storage.runs import RagDisabled, RunInProgress, RunStore
from ragstream.transport.kafka import KafkaTransport

__all__ = ["FetcherSettings", "create_app"]

logger = logging.getLogger(__name__)


class FetcherSettings(BaseSettings):
    """What only the fetcher reads; everything shared comes from ``Settings``."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_FETCHER_")

    folders: Annotated[list[Path], Field(title="Folders synced on the timer")] = []
    interval_s: Annotated[float, Field(title="Seconds between timed syncs; 0 disables the timer", ge=0)] = 3600


def create_app() -> FastAPI:
    """Refuses to build without ``RAGSTREAM_API_KEYS`` unless ``RAGSTREAM_AUTH=none``."""
    settings = Settings()
    configure_logging(settings.logs)
    access = Access.for_service(settings, "connector-fetcher")
    fetcher = FetcherSettings()
    broker = create_broker(settings.kafka_bootstrap_servers, "connector-fetcher")
    state: dict[str, Runtime] = {}

    async def ready() -> bool:
        if "runtime" not in state:
            return False
        await ping(state["runtime"].pool, settings.readiness_timeout_s)
        return True

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.database_url:
            raise RuntimeError("DATABASE_URL must be set for the connector-fetcher service")
        await ensure_topics(settings.kafka_bootstrap_servers)
        await broker.start()
        try:
            async with (
                open_runtime(settings, settings.database_url) as runtime,
                _control_plane(app, runtime, broker, fetcher.folders) as runner,
            ):
                background = [asyncio.create_task(runner.serve())]
                if fetcher.folders and fetcher.interval_s:
                    background.append(asyncio.create_task(_timer(runtime, runner, fetcher)))
                if settings.scheduler_enabled:
                    # One leader across the fetcher replicas enqueues due connections; every replica claims.
                    scheduler = Scheduler(
                        runtime.dsn, runner.runs, interval_s=settings.scheduler_interval_s, on_enqueued=runner.wake
                    )
                    background.append(asyncio.create_task(scheduler.run()))
                state["runtime"] = runtime
                try:
                    yield
                finally:
                    state.clear()
                    for task in background:
                        task.cancel()
                    # Wait, so cancelled syncs are recorded as failed before the pool closes.
                    await asyncio.gather(*background, return_exceptions=True)
        finally:
            await broker.stop()

    # The control-plane routes join once the runtime is open (they act on its pool and stores); the
    # app's check puts them behind ``access`` like every route.
    return create_http_app(
        None,
        ready=ready,
        title="ragstream connector-fetcher",
        access=access,
        max_request_bytes=settings.max_request_bytes,
        lifespan=lifespan,
    )


@asynccontextmanager
async def _control_plane(
    app: FastAPI, runtime: Runtime, broker: KafkaBroker, own_folders: list[Path]
) -> AsyncIterator[Runner]:
    """The runner of sync jobs over Kafka, and the control-plane routes of ``ragstream up`` on ``app``."""
    settings = runtime.settings
    # One per process: its session owns the runs this fetcher is executing (see RunStore).
    runs = RunStore(
        runtime.pool,
        runtime.dsn,
        stale_timeout_s=settings.sync_stale_timeout_s,
        cipher=CredentialCipher.from_settings(settings),
    )
    transport = KafkaTransport(broker, DownstreamStore(runtime.pool), poll_interval_s=settings.sync_progress_interval_s)
    job = SyncJob(runtime.store, transport, max_document_bytes=settings.max_document_bytes)
    # A replay publishes the failed documents to doc.changed again, from the failures table or the
    # dead-letter topic; the stage services take it from there.
    replay = topic_replay_kind(
        runtime.store, KafkaChangeSink(broker), lambda: dead_letters(settings.kafka_bootstrap_servers)
    )
    runner = Runner(
        runs,
        run_kinds(runs, lambda: job, runtime.reindexer(), runtime.rechunker(), replay),
        max_concurrent=settings.max_concurrent_syncs,
        progress_interval_s=settings.sync_progress_interval_s,
    )

    for router in control_plane_routers(runtime, runs, runner, [FAILURES, DEAD_LETTER], own_folders=own_folders):
        app.include_router(router)
    # The knowledge tool's writes start a sync run, which only the control plane can: here they are
    # served (the retriever serves the read-side actions and answers writes with not_served_here).
    knowledge = writing_knowledge(runtime, runs, runner, lambda: runtime.retriever)
    app.include_router(knowledge_router(lambda: knowledge))
    try:
        yield runner
    finally:
        await runs.aclose()


async def _timer(runtime: Runtime, runner: Runner, fetcher: FetcherSettings) -> None:
    """Queue a sync of each of ``RAGSTREAM_FETCHER_FOLDERS`` every ``interval_s``."""
    while True:
        for folder in fetcher.folders:
            try:
                connection_id = await register_folder(runtime.store, folder)
                await runner.runs.start(connection_id, "schedule")
            except (RunInProgress, RagDisabled, NotADirectoryError) as error:
                logger.warning("timed sync of %s not started: %s", folder, error)
        runner.wake()
        await asyncio.sleep(fetcher.interval_s)
