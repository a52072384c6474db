"""Assembles the stage objects from settings: one place, used by the CLI and by every service."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncpg

from ragstream.chat import ChatClient
from ragstream.chunking import MarkdownChunking
from ragstream.contextual import ChunkContextualizer
from ragstream.credentials import CredentialCipher
from ragstream.embedding import Embedder, create_embedder
from ragstream.embedding.dashscope import DEFAULT_BASE_URL as DASHSCOPE_BASE_URL
from ragstream.embedding.spaces import ActiveSpace
from ragstream.failures import StageRetry
from ragstream.knowledge.models import IndexingState
from ragstream.knowledge.service import KnowledgeService, Searcher
from ragstream.parsing import Parser
from ragstream.parsing_pool import ParserPool
from ragstream.pipeline import EmbeddedPipeline
from ragstream.rechunk import Rechunker
from ragstream.reindex import Reindexer
from ragstream.retrieval import HybridRetriever, RetrievalSettings
from ragstream.retrieval.direct import DirectSearch
from ragstream.retrieval.fusion import ConvexFusion, DistributionFusion, OneFusion, RrfFusion
from ragstream.retrieval.reader import DocumentReader
from ragstream.retrieval.rephrase import DashScopeChatRephraser, QueryRephraser
from ragstream.retrieval.rerank import DashScopeReranker, Reranker
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.settings import Settings
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.chunk_contexts import ChunkContextStore
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import close_pool, connect_pool
from ragstream.storage.direct_connections import DirectConnectionStore
from ragstream.storage.documents import DocumentStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.knowledge import KnowledgeStore
from ragstream.storage.postings import ImpactOrderedPostings
from ragstream.storage.rechunk import RechunkStore
from ragstream.storage.search import SearchStore
from ragstream.storage.spaces import SpaceStore
from ragstream.storage.term_lists import TermLists

__all__ = [
    "Database",
    "Runtime",
    "chosen_fusion",
    "create_contextualizer",
    "create_rephraser",
    "create_reranker",
    "keyword_postings",
    "open_database",
    "open_runtime",
    "resolve_database",
    "warm_keyword_lists",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Runtime:
    """The per-process singletons: pool, stores, embedder and the stage services built on them.

    ``embedder`` is the configured model (the chunkers count its tokens); ``spaces`` gives the model
    that embeds for search and ingest, which a re-index changes."""

    settings: Settings
    # The pool's DSN, for what must hold a connection of its own (the scheduler's leader lock).
    dsn: str
    pool: asyncpg.Pool
    store: DocumentStore
    embedder: Embedder
    spaces: ActiveSpace
    chunker: ChunkService
    embed: EmbedService
    indexer: IndexService
    retriever: HybridRetriever
    contextualizer: ChunkContextualizer | None = None

    def pipeline(self) -> EmbeddedPipeline:
        return EmbeddedPipeline(
            self.store,
            self.chunker,
            self.embed,
            self.indexer,
            max_document_bytes=self.settings.max_document_bytes,
            workers=self.settings.ingest_workers,
            retry=self.stage_retry(),
        )

    def stage_retry(self) -> StageRetry:
        retry = self.settings.stage_retry
        return StageRetry(attempts=retry.attempts, backoff_s=retry.backoff_s, backoff_max_s=retry.backoff_max_s)

    def reindexer(self) -> Reindexer:
        return Reindexer(SpaceStore(self.pool), self.spaces, contextualizer=self.contextualizer)

    def rechunker(self) -> Rechunker:
        return Rechunker(RechunkStore(self.pool), self.chunker, self.spaces, contextualizer=self.contextualizer)

    def knowledge(
        self,
        searcher: Callable[[], Searcher | None],
        on_written: Callable[[str], Awaitable[IndexingState]] | None = None,
    ) -> KnowledgeService:
        """The knowledge tool over ``searcher``; writes only with ``on_written`` (the control plane's
        sync start), platform calls within the direct-search timeout."""
        cipher = CredentialCipher.from_settings(self.settings)
        return KnowledgeService(
            searcher,
            DocumentReader(DocumentReadStore(self.pool), CitationStore(self.pool)),
            KnowledgeStore(self.pool, cipher),
            CitationStore(self.pool),
            on_written=on_written,
            timeout_s=self.settings.direct_search_timeout_s,
        )

    def searcher(self) -> SearchWithDirect:
        """Hybrid retrieval over the indexed connections, with the RAG-off connections in scope searched
        live on their platforms at the same time; closed by its ``aclose``."""
        cipher = CredentialCipher.from_settings(self.settings)
        direct = DirectSearch(DirectConnectionStore(self.pool, cipher), timeout_s=self.settings.direct_search_timeout_s)
        return SearchWithDirect(self.retriever, direct, CitationStore(self.pool), rrf_k=self.settings.rrf_k)


@dataclass(frozen=True, slots=True)
class Database:
    """The database a process uses: its DSN, and the embedded server when it is one (``ragstream
    up`` watches it and starts it again if it dies)."""

    dsn: str
    embedded: EmbeddedPostgres | None = None


@asynccontextmanager
async def open_database(settings: Settings) -> AsyncIterator[Database]:
    """``DATABASE_URL`` when set, else the embedded PostgreSQL under the data folder: the one another
    process already runs there, or one started now and stopped on exit unless others still use it."""
    if settings.database_url:
        yield Database(settings.database_url)
        return
    server = EmbeddedPostgres(settings.data_dir / "postgres")
    dsn = server.start()
    try:
        yield Database(dsn, server)
    finally:
        server.stop()


@asynccontextmanager
async def resolve_database(settings: Settings) -> AsyncIterator[str]:
    """The DSN of ``open_database``."""
    async with open_database(settings) as database:
        yield database.dsn


def create_reranker(settings: Settings) -> Reranker | None:
    """The configured reranker, or ``None`` for ``RAGSTREAM_RERANKER=none``."""
    key = settings.dashscope_key()
    if settings.reranker == "none" or key is None:  # the settings validator rejects dashscope without a key
        return None
    host = (settings.dashscope_host() or DASHSCOPE_BASE_URL).rstrip("/")
    return DashScopeReranker(key.get_secret_value(), model=settings.reranker_model, base_url=host)


# Setting any of these makes the operator's fusion serve every embedding space without one of its own.
_FUSION_SETTINGS = frozenset({"fusion", "fusion_alpha", "rrf_k", "rrf_vector_weight", "rrf_keyword_weight"})


def chosen_fusion(settings: Settings) -> OneFusion | None:
    """The fusion the operator set (any ``RAGSTREAM_FUSION*`` or ``RAGSTREAM_RRF_*``), which then serves
    every space without a fusion of its own; None when nothing was set."""
    if not settings.model_fields_set & _FUSION_SETTINGS:
        return None
    if settings.fusion == "rrf":
        return RrfFusion(
            k=settings.rrf_k, vector_weight=settings.rrf_vector_weight, keyword_weight=settings.rrf_keyword_weight
        )
    if settings.fusion == "dbsf":
        return DistributionFusion.keyword_share(settings.fusion_alpha)
    return ConvexFusion(alpha=settings.fusion_alpha)


def create_contextualizer(settings: Settings, pool: asyncpg.Pool) -> ChunkContextualizer | None:
    """The configured contextual retrieval, or ``None`` for ``RAGSTREAM_CONTEXTUAL_RETRIEVAL=none``."""
    key = settings.dashscope_key()
    if settings.contextual_retrieval == "none" or key is None:  # the settings validator rejects no key
        return None
    host = (settings.dashscope_host() or DASHSCOPE_BASE_URL).rstrip("/")
    chat = ChatClient(key.get_secret_value(), settings.contextual_model, f"{host}/compatible-mode/v1", timeout_s=30.0)
    return ChunkContextualizer(chat, ChunkContextStore(pool), document_chars=settings.contextual_document_chars)


async def warm_keyword_lists(runtime: Runtime) -> None:
    """A retriever's start, in the background: the keyword leg's most frequent term lists loaded
    before the first searches need them. A failure is logged; searches then load lists as they go."""
    started = time.perf_counter()
    try:
        loaded = await runtime.retriever.warm_keyword_lists()
    except Exception:
        logger.warning("the keyword leg's term lists were not loaded ahead", exc_info=True)
        return
    logger.info("keyword leg: %d term lists loaded ahead in %.1f s", loaded, time.perf_counter() - started)


def keyword_postings(settings: Settings) -> ImpactOrderedPostings:
    """The keyword leg's postings reader: rounds, and whole term lists within the settings' memory."""
    budget = settings.keyword_lists_mb << 20
    return ImpactOrderedPostings(whole_lists=TermLists(budget) if budget else None)


def create_rephraser(settings: Settings) -> QueryRephraser | None:
    """The configured query rephraser, or ``None`` for ``RAGSTREAM_REPHRASER=none``."""
    key = settings.dashscope_key()
    if settings.rephraser == "none" or key is None:
        return None
    host = (settings.dashscope_host() or DASHSCOPE_BASE_URL).rstrip("/")
    return DashScopeChatRephraser(
        key.get_secret_value(), model=settings.rephraser_model, base_url=f"{host}/compatible-mode/v1"
    )


@asynccontextmanager
async def open_runtime(settings: Settings, dsn: str) -> AsyncIterator[Runtime]:
    pool = await connect_pool(dsn, max_size=settings.db_pool_size, acquire_timeout_s=settings.db_pool_timeout_s)
    embedder = create_embedder(settings.embedding)
    parsers = ParserPool(
        Parser(settings.max_document_bytes),
        workers=settings.parse_workers,
        timeout_s=settings.parse_timeout_s,
        memory_mb=settings.parse_memory_mb,
    )
    spaces = ActiveSpace(SpaceStore(pool), settings.embedding, embedder)
    reranker: Reranker | None = None
    rephraser: QueryRephraser | None = None
    contextualizer: ChunkContextualizer | None = None
    try:
        await spaces.activate()
        reranker = create_reranker(settings)
        rephraser = create_rephraser(settings)
        contextualizer = create_contextualizer(settings, pool)
        store = DocumentStore(pool)
        chunking = settings.chunking
        yield Runtime(
            settings=settings,
            dsn=dsn,
            pool=pool,
            store=store,
            embedder=embedder,
            spaces=spaces,
            chunker=ChunkService(
                store,
                parsers,
                embedder,
                # Connections without a chunking config of their own get the settings' Markdown chunker.
                MarkdownChunking(size=chunking.size, overlap=chunking.overlap),
                chunking.batch_chunks,
            ),
            embed=EmbedService(embedder, spaces, contextualizer),
            indexer=IndexService(store),
            retriever=HybridRetriever(
                SearchStore(
                    pool,
                    ef_search=settings.hnsw_ef_search,
                    bm25_k1=settings.bm25_k1,
                    bm25_b=settings.bm25_b,
                    bigram_weight=settings.bm25_bigram_weight,
                    statement_timeout_s=settings.search_limits.statement_timeout_s,
                    postings=keyword_postings(settings),
                ),
                embedder,
                CitationStore(pool),
                settings=RetrievalSettings(fusion=chosen_fusion(settings)),
                reranker=reranker,
                rephraser=rephraser,
                spaces=spaces,
            ),
            contextualizer=contextualizer,
        )
    finally:
        for client in (rephraser, reranker, contextualizer):
            if client is not None:
                await client.aclose()
        await spaces.aclose()
        await parsers.aclose()
        await embedder.aclose()
        await close_pool(pool, settings.shutdown_timeout_s)
