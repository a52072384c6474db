"""``ragstream up``: the HTTP API and periodic folder syncs sharing one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvicorn
from fastapi import HTTPException

from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.api.reindex import reindex_router
from ragstream.api.replays import ReplayRequest, ReplayResult, replay_router
from ragstream.credentials import CredentialCipher
from ragstream.pipeline import SyncProgress, SyncReport
from ragstream.retrieval.reader import DocumentReader
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.storage.spaces import SpaceStore

__all__ = ["serve"]


async def serve(
    runtime: Runtime,
    sources: list[Path],
    host: str,
    port: int,
    sync_interval: float,
    sync_folder: Callable[[Runtime, Path, Callable[[str, SyncProgress], None]], Awaitable[SyncReport]],
) -> None:
    progress: dict[str, SyncProgress] = {}

    async def ready() -> bool:
        return bool(await runtime.pool.fetchval("SELECT true"))

    async def keep_synced() -> None:
        while True:
            for folder in sources:
                await sync_folder(runtime, folder, progress.__setitem__)
            if sync_interval <= 0:
                return
            await asyncio.sleep(sync_interval)

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

    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    reindexer = runtime.reindexer()
    app = create_app(
        lambda: runtime.retriever,
        ready=ready,
        sync_progress=lambda: progress,
        reader=lambda: reader,
        routers=[
            connections_router(ConnectionStore(runtime.pool, CredentialCipher.from_settings(runtime.settings))),
            replay_router(replay),
            reindex_router(reindexer, SpaceStore(runtime.pool)),
        ],
        title="ragstream",
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    syncing = asyncio.create_task(keep_synced())
    try:
        await server.serve()
    finally:
        syncing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await syncing
        await reindexer.aclose()
