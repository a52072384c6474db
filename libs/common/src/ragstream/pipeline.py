"""The embedded pipeline: the sync job over the in-memory transport, every stage in one process."""

from __future__ import annotations

from ragstream.failures import StageRetry
from ragstream.jobs.sync import SyncJob
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.documents import DocumentStore
from ragstream.transport.memory import MemoryTransport

__all__ = ["EmbeddedPipeline"]


class EmbeddedPipeline(SyncJob):
    """``SyncJob`` over a ``MemoryTransport`` of ``workers`` workers built from these stages."""

    def __init__(
        self,
        store: DocumentStore,
        chunker: ChunkService,
        embedder: EmbedService,
        indexer: IndexService,
        *,
        max_document_bytes: int,
        workers: int = 4,
        max_unembedded_ratio: float = 0.8,
        guard_min_chunks: int = 20,
        retry: StageRetry | None = None,
    ) -> None:
        super().__init__(
            store,
            MemoryTransport(store, chunker, embedder, indexer, workers=workers, retry=retry),
            max_document_bytes=max_document_bytes,
            max_unembedded_ratio=max_unembedded_ratio,
            guard_min_chunks=guard_min_chunks,
        )
