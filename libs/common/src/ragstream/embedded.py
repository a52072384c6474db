"""``ragstream up``: the HTTP and gRPC APIs, the sync runner and the scheduler sharing one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import HTTPException
from typing_extensions import override

from ragstream.api.connections import connections_router
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.api.rechunk import rechunk_router
from ragstream.api.reindex import reindex_router
from ragstream.api.replays import ReplayRequest, ReplayResult, replay_router
from ragstream.api.syncs import sync_router
from ragstream.connectors.registry import register_folder
from ragstream.control.runner import SyncRunner
from ragstream.control.runs import CONNECTION_ERRORS, SyncInProgress, SyncRunStore, Trigger
from ragstream.control.scheduler import Scheduler
from ragstream.credentials import CredentialCipher
from ragstream.retrieval.reader import DocumentReader
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.embedded_supervisor import EmbeddedSupervisor
from ragstream.storage.rechunk import RechunkStore
from ragstream.storage.spaces import SpaceStore

__all__ = ["serve"]


async def serve(
    runtime: Runtime,
    sources: list[Path],
    host: str,
    port: int,
    sync_interval: float,
    *,
    grpc_port: int,
    embedded: EmbeddedPostgres | None = None,
) -> None:
    """Each source folder becomes a ``folder`` connection synced now and then every ``sync_interval``
    seconds (0: only now) through sync runs, like any connection created over the API. The HTTP API
    listens on ``host:port``, the gRPC API on ``host:grpc_port`` (0: no gRPC). The ``embedded``
    PostgreSQL, if given, is started again should it die. SIGTERM and SIGINT stop it all."""
    settings = runtime.settings
    cipher = CredentialCipher.from_settings(settings)
    runs = SyncRunStore(runtime.pool, runtime.dsn, stale_timeout_s=settings.sync_stale_timeout_s, cipher=cipher)
    runner = SyncRunner(
        runs,
        runtime.pipeline,
        max_concurrent=settings.max_concurrent_syncs,
        progress_interval_s=settings.sync_progress_interval_s,
    )
    for folder in sources:
        connection_id = await register_folder(runtime.store, folder)
        await runs.set_schedule(connection_id, round(sync_interval))
        with contextlib.suppress(SyncInProgress):  # another process syncs it already
            await runs.start(connection_id, "cli")

    supervisor = EmbeddedSupervisor(embedded) if embedded is not None else None

    async def ready() -> bool:
        """True when the database answers; else an HTTP 503 that says why."""
        if supervisor is not None and supervisor.down:
            raise HTTPException(status_code=503, detail=supervisor.down)
        try:
            return bool(await runtime.pool.fetchval("SELECT true"))
        except CONNECTION_ERRORS as error:
            raise HTTPException(status_code=503, detail=f"the database is unavailable: {error}") from error

    def first_sync(trigger: Trigger) -> Callable[[str], Awaitable[None]]:
        """A connection created with RAG on, or switched back on, is synced in full right away."""

        async def start(connection_id: str) -> None:
            with contextlib.suppress(SyncInProgress):
                await runs.start(connection_id, trigger)
            runner.wake()

        return start

    async def replay(request: ReplayRequest) -> ReplayResult:
        if request.source == "dead-letter":
            raise HTTPException(status_code=422, detail="embedded mode has no dead-letter topic: replay failures")
        counts, replayed = await runtime.pipeline().replay(request.connection_id)
        return ReplayResult(
            replayed=counts.replayed,
            needs_sync=counts.needs_sync,
            resolved=counts.resolved,
            indexed=replayed.indexed,
            failed_again=replayed.failed,
        )

    connections = ConnectionStore(runtime.pool, cipher)
    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    reindexer = runtime.reindexer()
    rechunker = runtime.rechunker()

    async def resolve_embedding(spec: dict[str, Any]) -> tuple[str, int]:
        embedder = await runtime.spaces.resolve(spec)
        return embedder.model_key, embedder.dimension

    app = create_app(
        lambda: runtime.retriever,
        ready=ready,
        sync_progress=lambda: runner.live,
        reader=lambda: reader,
        routers=[
            connections_router(
                connections,
                on_created=first_sync("create"),
                on_rag_enabled=first_sync("api"),
                on_chunking_changed=rechunker.start,
                on_embedding_changed=lambda connection_id, spec: reindexer.start(spec, connection_id),
                resolve_embedding=resolve_embedding,
            ),
            rechunk_router(rechunker, RechunkStore(runtime.pool)),
            sync_router(lambda: runs, runner.wake),
            replay_router(replay),
            reindex_router(reindexer, SpaceStore(runtime.pool)),
        ],
        title="ragstream",
    )
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10))
    background = [asyncio.create_task(runner.serve())]
    if supervisor is not None:
        background.append(asyncio.create_task(supervisor.run()))
    if settings.scheduler_enabled:
        background.append(
            asyncio.create_task(
                Scheduler(runtime.dsn, runs, interval_s=settings.scheduler_interval_s, on_enqueued=runner.wake).run()
            )
        )
    try:
        async with _grpc(runtime, host, grpc_port, ready):
            await server.serve()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await runs.aclose()
        await reindexer.aclose()
        await rechunker.aclose()


class _Server(uvicorn.Server):
    """uvicorn's server, but a SIGTERM or SIGINT only ends ``serve()``: uvicorn raises the signal
    again afterwards, whose default action would kill the process before the cleanup (runs failed as
    cancelled, the embedded PostgreSQL stopped) has run."""

    @override
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextlib.asynccontextmanager
async def _grpc(runtime: Runtime, host: str, port: int, ready: Callable[[], Awaitable[bool]]) -> AsyncIterator[None]:
    """The gRPC API beside the HTTP one while the block runs, unless ``port`` is 0."""
    if not port:
        yield
        return
    async with grpc_server(lambda: runtime.retriever, host=host, port=port, ready=ready):
        yield
