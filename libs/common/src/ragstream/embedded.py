"""``ragstream up``: the HTTP and gRPC APIs, the sync runner and the scheduler sharing one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from typing_extensions import override

from ragstream.admission import SearchAdmission
from ragstream.api.auth import Access
from ragstream.api.control_plane import control_plane_routers, writing_knowledge
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.api.knowledge import knowledge_router
from ragstream.connectors.registry import register_folder
from ragstream.control.kinds import FAILURES, pipeline_replay_kind, run_kinds
from ragstream.control.runner import Runner
from ragstream.control.scheduler import Scheduler
from ragstream.credentials import CredentialCipher
from ragstream.knowledge.service import KnowledgeService
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.runtime import Runtime, warm_keyword_lists
from ragstream.storage.database import DatabaseUnavailable, ping
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.embedded_supervisor import EmbeddedSupervisor
from ragstream.storage.runs import RunInProgress, RunStore

__all__ = ["api_app", "serve"]

_KEEP_ALIVE_S = 20


async def serve(
    runtime: Runtime,
    sources: list[Path],
    host: str,
    port: int,
    sync_interval: float,
    *,
    grpc_port: int,
    access: Access,
    embedded: EmbeddedPostgres | None = None,
) -> None:
    """Each source folder becomes a ``folder`` connection synced now and then every ``sync_interval``
    seconds (0: only now) through sync runs, like any connection created over the API. The HTTP API
    listens on ``host:port``, the gRPC API on ``host:grpc_port`` (0: no gRPC), both behind ``access``
    (``Access.for_embedded`` checks the host first). The ``embedded`` PostgreSQL, if given, is started
    again should it die. SIGTERM and SIGINT stop it all."""
    settings = runtime.settings
    runs = RunStore(
        runtime.pool,
        runtime.dsn,
        stale_timeout_s=settings.sync_stale_timeout_s,
        cipher=CredentialCipher.from_settings(settings),
    )
    runner = Runner(
        runs,
        run_kinds(
            runs, runtime.pipeline, runtime.reindexer(), runtime.rechunker(), pipeline_replay_kind(runtime.pipeline)
        ),
        max_concurrent=settings.max_concurrent_syncs,
        progress_interval_s=settings.sync_progress_interval_s,
    )
    for folder in sources:
        connection_id = await register_folder(runtime.store, folder)
        await runs.set_schedule(connection_id, round(sync_interval))
        with contextlib.suppress(RunInProgress):  # another process syncs it already
            await runs.start(connection_id, "cli")

    admission = SearchAdmission.from_settings(settings)
    searcher = runtime.searcher()
    supervisor = EmbeddedSupervisor(embedded) if embedded is not None else None
    app = api_app(
        runtime,
        runs,
        runner,
        access=access,
        admission=admission,
        searcher=searcher,
        supervisor=supervisor,
        own_folders=sources,
    )
    # Keep-alive longer than clients keep idle connections (httpx: 5 s, uvicorn's default too): with
    # equal timeouts a client reusing a connection races the server closing it, and a busy client,
    # slow to send its next request, gets the connection reset.
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            log_config=None,  # its records go through the handler of ragstream.logs, in its format
            timeout_keep_alive=_KEEP_ALIVE_S,
            timeout_graceful_shutdown=round(settings.shutdown_timeout_s),
        )
    )
    background = [asyncio.create_task(runner.serve()), asyncio.create_task(warm_keyword_lists(runtime))]
    if supervisor is not None:
        background.append(asyncio.create_task(supervisor.run()))
    if settings.scheduler_enabled:
        background.append(
            asyncio.create_task(
                Scheduler(runtime.dsn, runs, interval_s=settings.scheduler_interval_s, on_enqueued=runner.wake).run()
            )
        )
    try:
        knowledge = writing_knowledge(runtime, runs, runner, lambda: searcher)
        async with _grpc(runtime, searcher, knowledge, host, grpc_port, access, admission, supervisor):
            await server.serve()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await runs.aclose()
        await searcher.aclose()


class _Server(uvicorn.Server):
    """uvicorn's server, but a SIGTERM or SIGINT only ends ``serve()``: uvicorn raises the signal
    again afterwards, whose default action would kill the process before the cleanup (runs failed as
    cancelled, the gRPC server, the pool and the embedded PostgreSQL stopped) has run."""

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


async def _ready(runtime: Runtime, supervisor: EmbeddedSupervisor | None) -> bool:
    """Raises ``DatabaseUnavailable`` while the embedded PostgreSQL is being restarted, ``DatabaseBusy``
    (or a connection error) when the pool cannot serve in time."""
    if supervisor is not None and supervisor.down:
        raise DatabaseUnavailable(supervisor.down)
    await ping(runtime.pool, runtime.settings.readiness_timeout_s)
    return True


def api_app(
    runtime: Runtime,
    runs: RunStore,
    runner: Runner,
    *,
    access: Access,
    admission: SearchAdmission | None = None,
    searcher: SearchWithDirect | None = None,
    supervisor: EmbeddedSupervisor | None = None,
    own_folders: Sequence[Path] = (),
) -> FastAPI:
    """The HTTP API of ``ragstream up``: search and the knowledge tool beside the control plane the
    connector-fetcher serves too. Search is ``searcher`` when given (live platforms beside the index),
    else the hybrid retriever alone."""

    async def ready() -> bool:
        return await _ready(runtime, supervisor)

    knowledge = writing_knowledge(runtime, runs, runner, lambda: searcher or runtime.retriever)
    return create_app(
        (lambda: searcher) if searcher is not None else (lambda: runtime.retriever),
        ready=ready,
        routers=[
            *control_plane_routers(runtime, runs, runner, [FAILURES], own_folders=own_folders),
            knowledge_router(lambda: knowledge, admission=admission),
        ],
        title="ragstream",
        access=access,
        max_request_bytes=runtime.settings.max_request_bytes,
        admission=admission,
    )


@contextlib.asynccontextmanager
async def _grpc(
    runtime: Runtime,
    searcher: SearchWithDirect,
    knowledge: KnowledgeService,
    host: str,
    port: int,
    access: Access,
    admission: SearchAdmission,
    supervisor: EmbeddedSupervisor | None,
) -> AsyncIterator[None]:
    """The gRPC API beside the HTTP one while the block runs, unless ``port`` is 0."""
    if not port:
        yield
        return

    async def ready() -> bool:
        return await _ready(runtime, supervisor)

    async with grpc_server(
        lambda: searcher,
        knowledge=lambda: knowledge,
        host=host,
        port=port,
        ready=ready,
        access=access,
        max_receive_bytes=runtime.settings.max_request_bytes,
        admission=admission,
        grace_s=runtime.settings.shutdown_timeout_s,
    ):
        yield
