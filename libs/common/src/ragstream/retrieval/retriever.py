"""Hybrid retrieval: scope → vector and keyword legs → fusion → optional rerank → budget → citations."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ragstream.core.search import SearchRequest, SearchResponse, SearchResult
from ragstream.core.vectors import Block, vector_blocks
from ragstream.embedding.base import Embedder, Vectors
from ragstream.embedding.bilingual import is_chinese
from ragstream.embedding.spaces import ActiveSpace
from ragstream.retrieval.budget import MAX_CALL_CHARS, MAX_RESULT_CHARS, preview, truncate_text
from ragstream.retrieval.fusion import (
    DEFAULT_FUSION,
    VECTOR,
    AnyFusion,
    DistributionFusion,
    OneFusion,
    RrfFusion,
    VectorScores,
    convex_fusion,
    distribution_fusion,
    effective_fusion,
    reciprocal_rank_fusion,
)
from ragstream.retrieval.rephrase import QueryRephraser, Rephrasing
from ragstream.retrieval.rerank import Reranker
from ragstream.segmentation import query_terms
from ragstream.storage.citations import CitationStore
from ragstream.storage.scope import Scope
from ragstream.storage.search import ChunkRecord, Hit, SearchedSpace, SearchStore

__all__ = ["HybridRetriever", "RetrievalSettings"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetrievalSettings:
    """``fusion``: the operator's choice for every space without a fusion of its own; None, each
    space fuses with the weights measured for its model (``MEASURED_FUSION``), else ``DEFAULT_FUSION``."""

    leg_size: int = 30
    fusion: OneFusion | None = None
    rerank_candidates: int = 30
    rerank_timeout_s: float = 5.0
    rephrase_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class _Leg:
    """One vector leg: a space's table, the query embedded by that space's model (one model for query
    and table), and the scope restricted to the connections whose space it is when there are several."""

    model_key: str
    table: str
    vector: Vectors
    scope: Scope
    restricted: bool
    block: Block | None = None

    @property
    def name(self) -> str:
        """Which ranking the leg feeds: its block's, else the one vector ranking of whole vectors."""
        return self.block.name if self.block is not None else VECTOR


@dataclass(frozen=True, slots=True)
class _Candidates:
    """What one snapshot of the database gave: both legs, and the fused candidates read back."""

    vector_hits: dict[str, list[Hit]]
    keyword_hits: list[Hit]
    ranked: list[tuple[ChunkRecord, float]]
    model_keys: list[str]


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
        """With ``spaces``, the vector leg runs in each embedding space of the connections in scope
        (their own model, else the active space's), the query embedded by each space's model; without,
        always by ``embedder`` in its own space."""
        self._store = store
        self._spaces = spaces
        self._embedder = embedder
        self._citations = citations
        self._settings = settings or RetrievalSettings()
        self._reranker = reranker
        self._rephraser = rephraser

    async def search(self, request: SearchRequest, plan: Rephrasing | None = None) -> SearchResponse:
        """Search ``request``; ``plan`` is the rephraser's decision when the caller already asked for it
        (``plan``), else it is asked here. Chit-chat searches nothing and carries the reply."""
        started = time.perf_counter()
        decided = plan if plan is not None else await self.plan(request)
        if decided.outcome == "chitchat":
            return SearchResponse(
                query=request.query,
                rephrase_outcome="chitchat",
                reply=decided.reply,
                results=[],
                took_ms=round((time.perf_counter() - started) * 1000, 2),
            )
        query = decided.query
        # Both legs put their own two parameters first, so one clause serves both.
        scope = Scope.build(request.filters, request.principal, first_param=3)
        terms = query_terms(query)
        wanted = max(request.top_k, self._settings.rerank_candidates if self._reranker else 0)
        found = await self._candidates(query, terms, scope, request.filters.connection_ids, wanted)
        ranked, reranked = await self._rerank(query, found.ranked, request.top_k)
        results = await self._results(
            request, ranked[: request.top_k], terms, found.vector_hits, found.keyword_hits, found.model_keys
        )
        return SearchResponse(
            query=request.query,
            rewritten_query=query if query != request.query else None,
            rephrase_outcome=decided.outcome,
            results=results,
            reranked=reranked,
            embedding_space=found.model_keys[0] if found.model_keys else None,
            embedding_spaces=found.model_keys,
            took_ms=round((time.perf_counter() - started) * 1000, 2),
        )

    async def warm_keyword_lists(self) -> int:
        """Load the keyword leg's most frequent term lists ahead of the first searches
        (``SearchStore.warm_keyword_lists``); returns how many."""
        return await self._store.warm_keyword_lists()

    async def plan(self, request: SearchRequest) -> Rephrasing:
        """What to search for ``request``: the rephraser's decision within its timeout, else the query
        as sent (no rephraser, the caller opted out, or it failed: the raw question is still usable)."""
        if self._rephraser is None or not request.rephrase:
            return Rephrasing.original(request.query)
        try:
            async with asyncio.timeout(self._settings.rephrase_timeout_s):
                decided = await self._rephraser.rephrase(request.query, request.history, request.user_context)
        except Exception as error:
            logger.warning("query rephrasing failed, searching the raw query: %s", error)
            return Rephrasing.original(request.query)
        if decided.outcome != "chitchat" and decided.query.strip() in ("", request.query):
            return Rephrasing.original(request.query)
        return decided

    async def _candidates(
        self, query: str, terms: list[str], scope: Scope, connection_ids: list[str] | None, wanted: int
    ) -> _Candidates:
        """Both legs, the fusion and the read-back, all in one snapshot of the database
        (``SearchStore.snapshot``): a re-chunk or re-index switch, a deletion or a commit landing
        meanwhile is seen by every statement or by none, so a search never mixes two index versions
        or two models of a connection, nor loses at the read-back a chunk its legs found.

        The snapshot says which spaces the connections in scope use; the query is embedded once per
        model: before the snapshot by the models the cache expects, by any other once the snapshot
        named it (after a re-index switch the cache had not seen), while the keyword leg runs.

        The cached layout is read before the snapshot, never in it: the snapshot holds the search's
        one pool connection, and a cache refresh needs another (with every connection held by a
        snapshot waiting for one more, the pool would never give any back)."""
        expected = await self._expected_embedders(connection_ids)
        active = (await self._spaces.current()).model_key if self._spaces is not None else None
        embeddings = {embedder.model_key: asyncio.create_task(self._embed(embedder, query)) for embedder in expected}
        try:
            # Embedded before the snapshot opens: a snapshot waiting on a slow embedder would sit idle in
            # its transaction, holding its pool connection until the idle timeout ends it.
            await asyncio.gather(*embeddings.values())
            async with self._store.snapshot() as store:
                spaces = await self._searched_spaces(store, connection_ids, active)
                for space in spaces:
                    if space.model_key not in embeddings:
                        embedder = self._embedder_of(space)
                        embeddings[space.model_key] = asyncio.create_task(self._embed(embedder, query))
                keyword = await store.keyword_leg(terms, self._settings.leg_size, scope, query=query)
                fusion = self._fusion_of(spaces).for_query(query)
                legs = [
                    leg
                    for space in spaces
                    for leg in self._legs_of(space, await embeddings[space.model_key], scope, len(spaces))
                    if leg.block is None or fusion.uses(leg.name)  # a block weighing 0 is not searched
                ]
                vector = await self._vector_legs(store, legs)
                fused = await self._fuse(store, legs, vector, keyword, fusion, query)
                records = await store.chunks([chunk for chunk, _ in fused[:wanted]])
        finally:
            for task in embeddings.values():
                task.cancel()
            # Those no leg needed (the cache was stale) end here, their errors with them.
            await asyncio.gather(*embeddings.values(), return_exceptions=True)
        ranked = [(records[chunk], score) for chunk, score in fused[:wanted] if chunk in records]
        return _Candidates(vector, keyword, ranked, list(dict.fromkeys(leg.model_key for leg in legs)))

    async def _expected_embedders(self, connection_ids: list[str] | None) -> list[Embedder]:
        """The models of the scope as last cached: the default's for every connection, else those
        of the connections named."""
        if self._spaces is None:
            return [self._embedder]
        if connection_ids is None:
            return [(await self._spaces.current()).embedder]
        spaces = [await self._spaces.for_connection(connection) for connection in connection_ids]
        return list({space.model_key: space.embedder for space in spaces}.values())

    async def _searched_spaces(
        self, store: SearchStore, connection_ids: list[str] | None, cached_active: str | None
    ) -> list[SearchedSpace]:
        """The spaces to search as the snapshot sees them: those of the connections in scope, or
        without ``spaces`` the embedder's own (none when nothing was ever embedded). ``cached_active``:
        the active space's model as the cache had it before the snapshot."""
        if self._spaces is None:
            own = await store.space(self._embedder.model_key)
            return [own] if own is not None else []
        spaces = await store.searched_spaces(connection_ids)
        active = next((space for space in spaces if space.active), None)
        if active is not None and active.model_key != cached_active:
            self._spaces.invalidate()  # a re-index switched since the cache was read
        return spaces

    def _embedder_of(self, space: SearchedSpace) -> Embedder:
        assert self._spaces is not None  # without spaces, the one space is the embedder's own
        return self._spaces.embedder(space.model_key, space.spec)

    @staticmethod
    async def _embed(embedder: Embedder, query: str) -> Vectors:
        vector: Vectors = (await embedder.embed([query], kind="query"))[0]
        return vector

    @classmethod
    def _legs_of(cls, space: SearchedSpace, vector: Vectors, scope: Scope, spaces: int) -> list[_Leg]:
        """The space's vector legs: one, or one per block of its vectors (``core.vectors.BLOCKS``)."""
        leg_scope, restricted = cls._leg_scope(scope, space, spaces)
        blocks = vector_blocks(space.model_key)
        if not blocks:
            return [_Leg(space.model_key, space.table, vector, leg_scope, restricted)]
        return [_Leg(space.model_key, space.table, block.of(vector), leg_scope, restricted, block) for block in blocks]

    @staticmethod
    def _leg_scope(scope: Scope, space: SearchedSpace, legs: int) -> tuple[Scope, bool]:
        """The scope of ``space``'s leg: with several legs, only the connections whose effective space
        it is (a table also holds the vectors a re-index builds for connections of another leg)."""
        if legs == 1:
            return scope, False
        if space.active:
            return scope.restricted("coalesce(k.embedding_model_key, {param}) = {param}", space.model_key), True
        return scope.restricted("k.embedding_model_key = {param}", space.model_key), True

    async def _vector_legs(self, store: SearchStore, legs: list[_Leg]) -> dict[str, list[Hit]]:
        """Each leg's nearest chunks, per ranking: the legs of whole vectors in one, each block in its
        own (a space of blocks, ``core.vectors.BLOCKS``). Legs of one ranking from several spaces are
        merged by cosine similarity. The cosines of two models are only roughly comparable (each model
        spreads its similarities differently), so when a scope spans connections of several models the
        merged order favours the model with higher cosines; within one connection all scores come from
        one model. Fusion with the keyword leg then reorders."""
        size = self._settings.leg_size
        rankings: dict[str, list[list[Hit]]] = {}
        for leg in legs:
            hits = await store.vector_leg(leg.table, leg.vector, size, leg.scope, leg.block)
            rankings.setdefault(leg.name, []).append(hits)
        return {
            name: sorted((hit for hits in parts for hit in hits), key=lambda hit: (-hit.score, hit.chunk_id))[:size]
            if len(parts) > 1
            else parts[0]
            for name, parts in rankings.items()
        }

    def _fusion_of(self, spaces: list[SearchedSpace]) -> AnyFusion:
        """The effective fusion of the first space searched (the default space when it is one of them)."""
        space = spaces[0] if spaces else None
        if space is None:
            return self._settings.fusion or DEFAULT_FUSION
        return effective_fusion(space.model_key, space.fusion, self._settings.fusion)[0]

    async def _fuse(
        self,
        store: SearchStore,
        legs: list[_Leg],
        vector: dict[str, list[Hit]],
        keyword: list[Hit],
        fusion: OneFusion,
        query: str,
    ) -> list[tuple[str, float]]:
        """The keyword leg fused with every vector ranking, each weighted as ``fusion`` says for its name.
        Beside a space of blocks, the ranking of whole vectors (connections of another model in the same
        scope) weighs as much as all the blocks together: each connection's chunks get one vector side."""
        weights = {name: fusion.weight_of(name) for name in vector}
        if VECTOR in weights and len(weights) > 1:
            weights[VECTOR] = sum(weight for name, weight in weights.items() if name != VECTOR)
        if isinstance(fusion, RrfFusion):
            return reciprocal_rank_fusion(
                [[hit.chunk_id for hit in hits] for hits in vector.values()] + [[hit.chunk_id for hit in keyword]],
                weights=[*weights.values(), fusion.keyword_weight],
                k=fusion.k,
                item_weights=[*await self._across_languages(store, vector, fusion, query), {}],
            )
        scored = []
        for name, hits in vector.items():
            similarity: dict[str, float] = {}
            found = {hit.chunk_id for hit in hits}
            missing = [hit.chunk_id for hit in keyword if hit.chunk_id not in found]
            for leg in legs if missing and weights[name] > 0 else []:  # a ranking that weighs 0 adds nothing
                if leg.name == name:
                    # Each chunk's similarity in its own connection's space: the leg's scope says whose.
                    scope = leg.scope if leg.restricted else None
                    similarity.update(await store.similarities(leg.table, leg.vector, missing, scope, leg.block))
            scored.append(VectorScores(weights[name], hits, similarity))
        if isinstance(fusion, DistributionFusion):
            return distribution_fusion(
                scored,
                keyword,
                keyword_weight=fusion.keyword_weight,
                item_weights=await self._across_languages(store, vector, fusion, query),
            )
        return convex_fusion(scored, keyword, alpha=fusion.alpha)

    async def _across_languages(
        self, store: SearchStore, vector: dict[str, list[Hit]], fusion: RrfFusion | DistributionFusion, query: str
    ) -> list[dict[str, float]]:
        """Per vector ranking, the weight of its hits in another language than the query's, for the
        rankings ``fusion.cross_language_weights`` names."""
        return [
            await self._other_language(store, hits, query, fusion.cross_language_weights[name])
            if name in fusion.cross_language_weights
            else {}
            for name, hits in vector.items()
        ]

    @staticmethod
    async def _other_language(store: SearchStore, hits: list[Hit], query: str, weight: float) -> dict[str, float]:
        """``weight`` for each hit whose text is in another language than the query (Chinese or not, as the
        bilingual embedder tells them apart)."""
        chinese = is_chinese(query)
        records = await store.chunks([hit.chunk_id for hit in hits])
        return {chunk: weight for chunk, record in records.items() if is_chinese(record.text) != chinese}

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
        vector_hits: dict[str, list[Hit]],
        keyword_hits: list[Hit],
        model_keys: list[str],
    ) -> list[SearchResult]:
        documents = list(dict.fromkeys(record.document_id for record, _ in ranked))
        if request.conversation_id:
            numbers = await self._citations.assign(request.conversation_id, documents)
        else:
            numbers = {document: index for index, document in enumerate(documents, start=1)}
        searched = model_keys[0] if model_keys else None
        vector_rank: dict[str, int] = {}  # the best rank a chunk has in any vector ranking
        for hits in vector_hits.values():
            for rank, hit in enumerate(hits, start=1):
                vector_rank[hit.chunk_id] = min(rank, vector_rank.get(hit.chunk_id, rank))
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
                    # Without spaces there is one leg, in the embedder's space, whatever the connection's.
                    embedding_space=record.embedding_space if self._spaces is not None else searched,
                )
            )
        return results
