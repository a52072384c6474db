"""``ragstream up``: the HTTP and gRPC APIs, the sync runner and the scheduler sharing one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import HTTPException

from ragstream.api.connections import connections_router
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.api.rechunk import rechunk_router
from ragstream.api.reindex import reindex_router
from ragstream.api.replays import ReplayRequest, ReplayResult, replay_router
from ragstream.api.syncs import sync_router
from ragstream.connectors.registry import register_folder
from ragstream.control.runner import SyncRunner
from ragstream.control.runs import SyncInProgress, SyncRunStore, Trigger
from ragstream.control.scheduler import Scheduler
from ragstream.credentials import CredentialCipher
from ragstream.retrieval.direct import DirectSearch
from ragstream.retrieval.reader import DocumentReader
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.direct_connections import DirectConnectionStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.storage.rechunk import RechunkStore
from ragstream.storage.spaces import SpaceStore

__all__ = ["serve"]


async def serve(
    runtime: Runtime, sources: list[Path], host: str, port: int, sync_interval: float, *, grpc_port: int
) -> None:
    """Each source folder becomes a ``folder`` connection synced now and then every ``sync_interval``
    seconds (0: only now) through sync runs, like any connection created over the API. The HTTP API
    listens on ``host:port``, the gRPC API on ``host:grpc_port`` (0: no gRPC)."""
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

    async def ready() -> bool:
        return bool(await runtime.pool.fetchval("SELECT true"))

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
    direct = DirectSearch(DirectConnectionStore(runtime.pool, cipher), timeout_s=settings.direct_search_timeout_s)
    searcher = SearchWithDirect(runtime.retriever, direct, CitationStore(runtime.pool), rrf_k=settings.rrf_k)
    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    reindexer = runtime.reindexer()
    rechunker = runtime.rechunker()

    async def resolve_embedding(spec: dict[str, Any]) -> tuple[str, int]:
        embedder = await runtime.spaces.resolve(spec)
        return embedder.model_key, embedder.dimension

    app = create_app(
        lambda: searcher,
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
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    background = [asyncio.create_task(runner.serve())]
    if settings.scheduler_enabled:
        background.append(
            asyncio.create_task(
                Scheduler(runtime.dsn, runs, interval_s=settings.scheduler_interval_s, on_enqueued=runner.wake).run()
            )
        )
    try:
        async with _grpc(searcher, host, grpc_port, ready):
            await server.serve()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await runs.aclose()
        await reindexer.aclose()
        await rechunker.aclose()
        await searcher.aclose()


@contextlib.asynccontextmanager
async def _grpc(
    searcher: SearchWithDirect, host: str, port: int, ready: Callable[[], Awaitable[bool]]
) -> AsyncIterator[None]:
    """The gRPC API beside the HTTP one while the block runs, unless ``port`` is 0."""
    if not port:
        yield
        return
    async with grpc_server(lambda: searcher, host=host, port=port, ready=ready):
        yield
