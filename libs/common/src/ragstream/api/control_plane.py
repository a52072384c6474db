"""The control-plane routers, one set for ``ragstream up`` and the connector-fetcher service:
connections, their syncs and status, re-chunk, re-index, runs of every kind, embedding spaces and
their fusion, replays and document reads; and the knowledge tool as the control plane serves it,
whose writes start syncs."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from ragstream.api.connections import connections_router
from ragstream.api.documents import documents_router
from ragstream.api.rechunk import connection_rechunk, rechunk_router
from ragstream.api.reindex import connection_reindex, reindex_router, spec_model_key
from ragstream.api.replays import replay_router
from ragstream.api.runs import runs_router
from ragstream.api.spaces import spaces_router
from ragstream.api.syncs import folder_syncs_router, sync_router
from ragstream.control.runner import Runner
from ragstream.credentials import CredentialCipher
from ragstream.knowledge.models import IndexingState
from ragstream.knowledge.service import KnowledgeService, Searcher
from ragstream.retrieval.reader import DocumentReader
from ragstream.runtime import Runtime, chosen_fusion
from ragstream.storage.citations import CitationStore
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.storage.runs import RagDisabled, RunInProgress, RunStore, Trigger
from ragstream.storage.spaces import SpaceStore

__all__ = ["control_plane_routers", "writing_knowledge"]


def control_plane_routers(
    runtime: Runtime,
    runs: RunStore,
    runner: Runner,
    replay_sources: Collection[str],
    *,
    own_folders: Sequence[Path] = (),
) -> list[APIRouter]:
    """Every control-plane route over a process's open ``runtime``. Runs of every kind are queued in
    ``runs`` and claimed by ``runner`` (woken at once), or any replica's; a replay runs on ``runner``
    in the request, from the ``replay_sources`` this mode can read (the Kafka mode reads the
    dead-letter topic too).
    ``own_folders``: folders the process syncs on its own, also allowed on ``POST /v1/syncs``."""
    settings = runtime.settings

    def first_sync(trigger: Trigger) -> Callable[[str], Awaitable[None]]:
        """A connection created with RAG on, or switched back on, is synced in full right away."""

        async def start(connection_id: str) -> None:
            with contextlib.suppress(RunInProgress):
                await runs.start(connection_id, trigger)
            runner.wake()

        return start

    async def resolve_embedding(spec: dict[str, Any]) -> tuple[str, int]:
        embedder = await runtime.spaces.resolve(spec)
        return embedder.model_key, embedder.dimension

    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    return [
        connections_router(
            ConnectionStore(runtime.pool, CredentialCipher.from_settings(settings)),
            on_created=first_sync("create"),
            on_rag_enabled=first_sync("api"),
            on_chunking_changed=connection_rechunk(runs, runner.wake),
            on_embedding_changed=connection_reindex(runs, runtime.spaces, SpaceStore(runtime.pool), runner.wake),
            resolve_embedding=resolve_embedding,
            folder_roots=settings.folders.roots(),
            allow_private_networks=settings.outbound.allow_private_networks,
        ),
        rechunk_router(runs, runner.wake),
        sync_router(lambda: runs, runner.wake),
        folder_syncs_router(
            runs,
            runtime.store,
            runner.live_syncs,
            runner.wake,
            folder_roots=settings.folders.roots(),
            own_folders=own_folders,
        ),
        replay_router(runs, runner, replay_sources),
        reindex_router(runs, SpaceStore(runtime.pool), spec_model_key(runtime.spaces), runner.wake),
        runs_router(runs),
        spaces_router(SpaceStore(runtime.pool), chosen_fusion(settings)),
        documents_router(lambda: reader),
    ]


def writing_knowledge(
    runtime: Runtime, runs: RunStore, runner: Runner, searcher: Callable[[], Searcher | None]
) -> KnowledgeService:
    """A document written to a RAG connection starts a sync run of it (``runs``, claimed by ``runner``)."""

    async def sync_written(connection_id: str) -> IndexingState:
        """Only the changed document is downloaded again; if a sync is running, its successor (the
        next one started) picks it up."""
        try:
            await runs.start(connection_id, "api")
        except RunInProgress:
            return "sync_running"
        except RagDisabled:  # switched off meanwhile: searched live
            return "live"
        runner.wake()
        return "sync_started"

    return runtime.knowledge(searcher, on_written=sync_written)
