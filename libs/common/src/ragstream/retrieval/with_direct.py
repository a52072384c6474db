"""Search with direct search beside it: local hybrid retrieval and the live platform searches run
concurrently, and their rankings are merged by Reciprocal Rank Fusion (the fused score replaces the
local one only when there are live hits to merge).

A live hit's document id is ``direct:<connection id>:<external id>``, so it keeps its citation
number in a conversation like an indexed document. Without a live connection in scope the local
response is returned as it is.
"""

from __future__ import annotations

import asyncio
import time

from ragstream.core.search import SearchRequest, SearchResponse, SearchResult
from ragstream.direct.base import LiveHit
from ragstream.retrieval.budget import MAX_CALL_CHARS, MAX_RESULT_CHARS, preview, truncate_text
from ragstream.retrieval.direct import DirectOutcome, DirectSearch
from ragstream.retrieval.fusion import RRF_K, reciprocal_rank_fusion
from ragstream.retrieval.retriever import HybridRetriever
from ragstream.segmentation import query_terms
from ragstream.storage.citations import CitationStore
from ragstream.storage.direct_connections import DirectConnection

__all__ = ["SearchWithDirect", "live_document_id", "merge_results"]


def live_document_id(connection_id: str, external_id: str) -> str:
    return f"direct:{connection_id}:{external_id}"


class SearchWithDirect:
    def __init__(
        self, retriever: HybridRetriever, direct: DirectSearch, citations: CitationStore, *, rrf_k: int = RRF_K
    ) -> None:
        self._retriever = retriever
        self._direct = direct
        self._citations = citations
        self._rrf_k = rrf_k

    async def aclose(self) -> None:
        await self._direct.aclose()

    async def search(self, request: SearchRequest) -> SearchResponse:
        """The rephraser decides first, so chit-chat reaches no platform and the live searches ask the
        same standalone question as the local legs."""
        started = time.perf_counter()
        plan = await self._retriever.plan(request)
        if plan.outcome == "chitchat":
            return await self._retriever.search(request, plan)
        live_task = asyncio.create_task(self._direct.search(request.model_copy(update={"query": plan.query})))
        try:
            local = await self._retriever.search(request, plan)
        except BaseException:
            live_task.cancel()
            await asyncio.gather(live_task, return_exceptions=True)
            raise
        live = await live_task
        if not live.results:  # nothing to merge: the local ranking and scores stand
            return local.model_copy(update={"degraded": live.degraded}) if live.degraded else local
        results = merge_results(request, local.results, live, k=self._rrf_k)
        documents = list(dict.fromkeys(result.document_id for result in results))
        if request.conversation_id:
            numbers = await self._citations.assign(request.conversation_id, documents)
        else:
            numbers = {document: number for number, document in enumerate(documents, start=1)}
        return local.model_copy(
            update={
                "results": [
                    result.model_copy(update={"citation_index": numbers[result.document_id]}) for result in results
                ],
                "degraded": live.degraded,
                "took_ms": round((time.perf_counter() - started) * 1000, 2),
            }
        )


def merge_results(
    request: SearchRequest, local: list[SearchResult], live: DirectOutcome, *, k: int = RRF_K
) -> list[SearchResult]:
    """The local results and each connection's live hits fused by RRF (each list one ranking of equal
    weight), the best ``top_k`` re-ranked and cut to the call's text budget. Citation numbers are
    left to the caller."""
    terms = query_terms(request.query)
    candidates: dict[str, SearchResult] = {result.chunk_id: result for result in local}
    rankings = [[result.chunk_id for result in local]]
    for found in live.results:
        ranking = []
        for hit in found.hits:
            result = _live_result(found.connection, hit, terms)
            candidates.setdefault(result.chunk_id, result)
            ranking.append(result.chunk_id)
        rankings.append(ranking)
    fused = reciprocal_rank_fusion(rankings, k=k)[: request.top_k]
    merged: list[SearchResult] = []
    budget = MAX_CALL_CHARS
    for chunk_id, score in fused:
        if budget <= 0:
            break
        result = candidates[chunk_id]
        text = truncate_text(result.text, min(MAX_RESULT_CHARS, budget))
        budget -= len(text)
        merged.append(result.model_copy(update={"rank": len(merged) + 1, "score": score, "text": text}))
    return merged


def _live_result(connection: DirectConnection, hit: LiveHit, terms: list[str]) -> SearchResult:
    document_id = live_document_id(connection.id, hit.external_id)
    return SearchResult(
        rank=0,
        score=0.0,
        citation_index=0,
        document_id=document_id,
        chunk_id=document_id,
        connection_id=connection.id,
        platform=connection.platform,
        knowledge_base=hit.knowledge_base,
        title=hit.title,
        source=hit.url or hit.external_id,
        url=hit.url,
        heading="",
        text=truncate_text(hit.text, MAX_RESULT_CHARS),
        preview=preview(hit.text, terms),
        mode="direct",
    )
