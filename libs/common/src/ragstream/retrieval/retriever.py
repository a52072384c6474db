"""Hybrid retrieval: scope → vector and keyword legs → fusion → optional rerank → budget → citations."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import asyncpg

from ragstream.embedding.base import Embedder, Vectors
from ragstream.embedding.spaces import ActiveSpace
from ragstream.retrieval.budget import MAX_CALL_CHARS, MAX_RESULT_CHARS, preview, truncate_text
from ragstream.retrieval.fusion import RRF_K, Fusion, convex_fusion, reciprocal_rank_fusion
from ragstream.retrieval.models import SearchRequest, SearchResponse, SearchResult
from ragstream.retrieval.rephrase import QueryRephraser
from ragstream.retrieval.rerank import Reranker
from ragstream.segmentation import query_terms
from ragstream.storage.citations import CitationStore
from ragstream.storage.scope import Scope
from ragstream.storage.search import ChunkRecord, Hit, SearchStore

__all__ = ["HybridRetriever", "RetrievalSettings"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetrievalSettings:
    leg_size: int = 30
    fusion: Fusion = "convex"
    convex_alpha: float = 0.6
    rrf_k: int = RRF_K
    vector_weight: float = 1.0
    keyword_weight: float = 1.0
    rerank_candidates: int = 30
    rerank_timeout_s: float = 5.0
    rephrase_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class _QueryVector:
    """The query embedded by a space's model, with that space's table: one model for query and table."""

    model_key: str
    table: str
    vector: Vectors


@dataclass(frozen=True, slots=True)
class _Candidates:
    """What one snapshot of the database gave: both legs, and the fused candidates read back."""

    vector_hits: list[Hit]
    keyword_hits: list[Hit]
    ranked: list[tuple[ChunkRecord, float]]
    model_key: str | None


class HybridRetriever:
    def __init__(
        self,
        store: SearchStore,
        embedder: Embedder,
        citations: CitationStore,
        *,
        settings: RetrievalSettings | None = None,
        reranker: Reranker | None = None,
        rephraser: QueryRephraser | None = None,
        spaces: ActiveSpace | None = None,
    ) -> None:
        """With ``spaces``, queries are embedded by the active space's model (it changes when a
        re-index switches); without, always by ``embedder`` in its own space."""
        self._store = store
        self._spaces = spaces
        self._embedder = embedder
        self._citations = citations
        self._settings = settings or RetrievalSettings()
        self._reranker = reranker
        self._rephraser = rephraser

    async def search(self, request: SearchRequest) -> SearchResponse:
        started = time.perf_counter()
        query = await self._standalone_query(request)
        # Both legs put their own two parameters first, so one clause serves both.
        scope = Scope.build(request.filters, request.principal, first_param=3)
        terms = query_terms(query)
        wanted = max(request.top_k, self._settings.rerank_candidates if self._reranker else 0)
        try:
            found = await self._candidates(query, terms, scope, wanted)
        except asyncpg.UndefinedTableError:
            if self._spaces is None:
                raise
            # A re-index switched and dropped the space's table after the space was read: search
            # the new active space instead, embedding the query again with its model.
            self._spaces.invalidate()
            found = await self._candidates(query, terms, scope, wanted)
        ranked, reranked = await self._rerank(query, found.ranked, request.top_k)
        results = await self._results(request, ranked[: request.top_k], terms, found.vector_hits, found.keyword_hits)
        return SearchResponse(
            query=request.query,
            rewritten_query=query if query != request.query else None,
            results=results,
            reranked=reranked,
            embedding_space=found.model_key,
            took_ms=round((time.perf_counter() - started) * 1000, 2),
        )

    async def _standalone_query(self, request: SearchRequest) -> str:
        if self._rephraser is None or not request.history:
            return request.query
        try:
            async with asyncio.timeout(self._settings.rephrase_timeout_s):
                return (await self._rephraser.rephrase(request.query, request.history)).strip() or request.query
        except Exception as error:  # the raw question is still a usable query
            logger.warning("query rephrasing failed, searching the raw query: %s", error)
            return request.query

    async def _candidates(self, query: str, terms: list[str], scope: Scope, wanted: int) -> _Candidates:
        """Both legs, the fusion and the read-back, all in one snapshot of the database
        (``SearchStore.snapshot``): a re-chunk switch, a deletion or a commit landing meanwhile is
        seen by every statement or by none, so a search never mixes two index versions of a
        connection, nor loses at the read-back a chunk its legs found. The query is embedded while
        the keyword leg runs."""
        embedding = asyncio.create_task(self._embed_query(query))
        try:
            async with self._store.snapshot() as store:
                keyword = await store.keyword_leg(terms, self._settings.leg_size, scope, query=query)
                embedded = await embedding
                vector = []
                if embedded is not None:
                    vector = await store.vector_leg(embedded.table, embedded.vector, self._settings.leg_size, scope)
                fused = await self._fuse(store, embedded, vector, keyword)
                records = await store.chunks([chunk for chunk, _ in fused[:wanted]])
        finally:
            embedding.cancel()
        ranked = [(records[chunk], score) for chunk, score in fused[:wanted] if chunk in records]
        return _Candidates(vector, keyword, ranked, embedded.model_key if embedded else None)

    async def _embed_query(self, query: str) -> _QueryVector | None:
        """The query in the active space (``None`` when nothing was ever embedded)."""
        if self._spaces is None:
            table = await self._store.embedding_table(self._embedder.model_key)
            if table is None:
                return None
            vector = (await self._embedder.embed([query], kind="query"))[0]
            return _QueryVector(self._embedder.model_key, table, vector)
        space = await self._spaces.current()
        vector = (await space.embedder.embed([query], kind="query"))[0]
        return _QueryVector(space.model_key, space.table, vector)

    async def _fuse(
        self, store: SearchStore, embedded: _QueryVector | None, vector: list[Hit], keyword: list[Hit]
    ) -> list[tuple[str, float]]:
        settings = self._settings
        if settings.fusion == "rrf":
            return reciprocal_rank_fusion(
                [[hit.chunk_id for hit in vector], [hit.chunk_id for hit in keyword]],
                weights=[settings.vector_weight, settings.keyword_weight],
                k=settings.rrf_k,
            )
        similarity: dict[str, float] = {}
        found = {hit.chunk_id for hit in vector}
        missing = [hit.chunk_id for hit in keyword if hit.chunk_id not in found]
        if missing and embedded is not None:
            similarity = await store.similarities(embedded.table, embedded.vector, missing)
        return convex_fusion(vector, keyword, alpha=settings.convex_alpha, similarity=similarity)

    async def _rerank(
        self, query: str, ranked: list[tuple[ChunkRecord, float]], top_k: int
    ) -> tuple[list[tuple[ChunkRecord, float]], bool]:
        if self._reranker is None or len(ranked) < 2:
            return ranked, False
        try:
            async with asyncio.timeout(self._settings.rerank_timeout_s):
                order = await self._reranker.rerank(query, [record.text for record, _ in ranked], top_k)
            if not order or any(not 0 <= index < len(ranked) for index, _ in order):
                raise ValueError("the reranker answered with unknown candidates")
        except Exception as error:  # a reranker is an optimisation, never a reason to fail a search
            logger.warning("rerank failed, keeping the fused order: %s", error)
            return ranked, False
        return [(ranked[index][0], score) for index, score in order], True

    async def _results(
        self,
        request: SearchRequest,
        ranked: list[tuple[ChunkRecord, float]],
        terms: list[str],
        vector_hits: list[Hit],
        keyword_hits: list[Hit],
    ) -> list[SearchResult]:
        documents = list(dict.fromkeys(record.document_id for record, _ in ranked))
        if request.conversation_id:
            numbers = await self._citations.assign(request.conversation_id, documents)
        else:
            numbers = {document: index for index, document in enumerate(documents, start=1)}
        vector_rank = {hit.chunk_id: rank for rank, hit in enumerate(vector_hits, start=1)}
        keyword_rank = {hit.chunk_id: rank for rank, hit in enumerate(keyword_hits, start=1)}
        results: list[SearchResult] = []
        budget = MAX_CALL_CHARS
        for record, score in ranked:
            if budget <= 0:
                break
            text = truncate_text(record.text, min(MAX_RESULT_CHARS, budget))
            budget -= len(text)
            results.append(
                SearchResult(
                    rank=len(results) + 1,
                    score=score,
                    citation_index=numbers[record.document_id],
                    document_id=record.document_id,
                    chunk_id=record.chunk_id,
                    connection_id=record.connection_id,
                    platform=record.platform,
                    knowledge_base=record.knowledge_base,
                    title=record.title,
                    source=record.source,
                    url=record.url,
                    heading=record.heading,
                    text=text,
                    preview=preview(record.text, terms),
                    vector_rank=vector_rank.get(record.chunk_id),
                    keyword_rank=keyword_rank.get(record.chunk_id),
                )
            )
        return results
