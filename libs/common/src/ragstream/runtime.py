"""Assembles the stage objects from settings: one place, used by the CLI and by every service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg

from ragstream.chunking import MarkdownChunker
from ragstream.embedding import Embedder, create_embedder
from ragstream.parsing import Parser
from ragstream.pipeline import EmbeddedPipeline
from ragstream.retrieval import HybridRetriever, RetrievalSettings
from ragstream.settings import Settings
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import connect_pool
from ragstream.storage.documents import DocumentStore
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.search import SearchStore

__all__ = ["Runtime", "open_runtime", "resolve_database"]


@dataclass(frozen=True, slots=True)
class Runtime:
    """The per-process singletons: pool, stores, embedder and the stage services built on them."""

    settings: Settings
    pool: asyncpg.Pool
    store: DocumentStore
    embedder: Embedder
    chunker: ChunkService
    embed: EmbedService
    indexer: IndexService
    retriever: HybridRetriever

    def pipeline(self) -> EmbeddedPipeline:
        return EmbeddedPipeline(
            self.store, self.chunker, self.embed, self.indexer, max_document_bytes=self.settings.max_document_bytes
        )


@asynccontextmanager
async def resolve_database(settings: Settings) -> AsyncIterator[str]:
    """``DATABASE_URL`` when set, else the embedded PostgreSQL under the data folder, stopped on exit."""
    if settings.database_url:
        yield settings.database_url
        return
    server = EmbeddedPostgres(settings.data_dir / "postgres")
    dsn = server.start()
    try:
        yield dsn
    finally:
        server.stop()


@asynccontextmanager
async def open_runtime(settings: Settings, dsn: str) -> AsyncIterator[Runtime]:
    pool = await connect_pool(dsn)
    embedder = create_embedder(settings.embedding)
    try:
        store = DocumentStore(pool)
        chunking = settings.chunking
        yield Runtime(
            settings=settings,
            pool=pool,
            store=store,
            embedder=embedder,
            chunker=ChunkService(
                store,
                Parser(settings.max_document_bytes),
                MarkdownChunker(chunking.size, chunking.overlap),
                chunking.batch_chunks,
            ),
            embed=EmbedService(embedder),
            indexer=IndexService(store),
            retriever=HybridRetriever(
                SearchStore(pool, ef_search=settings.hnsw_ef_search),
                embedder,
                CitationStore(pool),
                settings=RetrievalSettings(
                    vector_weight=settings.rrf_vector_weight, keyword_weight=settings.rrf_keyword_weight
                ),
            ),
        )
    finally:
        await embedder.aclose()
        await pool.close()
