"""Hybrid retrieval: a vector leg and a keyword leg fused by Reciprocal Rank Fusion, with citations."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Annotated

from pydantic import BaseModel, Field

from ragstream.embedding.base import Embedder
from ragstream.segmentation import query_terms
from ragstream.storage.search import SearchStore

__all__ = ["HybridRetriever", "SearchRequest", "SearchResponse", "SearchResult", "truncate_text"]

LEG_SIZE = 30
RRF_K = 60
MAX_RESULT_CHARS = 3000
MAX_CALL_CHARS = 12000
_SENTENCE_END = re.compile(r"(?<=[.!?。！？；;])\s*|\n+")


class SearchRequest(BaseModel):
    query: Annotated[str, Field(title="Query", min_length=1, max_length=4000)]
    top_k: Annotated[int, Field(title="Results to return", ge=1, le=30)] = 10
    connection_ids: Annotated[list[str] | None, Field(title="Only these connections")] = None


class SearchResult(BaseModel):
    rank: Annotated[int, Field(title="1-based rank after fusion")]
    score: Annotated[float, Field(title="RRF score")]
    citation_index: Annotated[int, Field(title="Citation number", description="Same document, same number.")]
    document_id: str
    chunk_id: str
    connection_id: str
    title: str
    source: Annotated[str, Field(title="Source", description="Path relative to the folder root, or the URL.")]
    heading: Annotated[str, Field(title="Heading path of the chunk")]
    text: Annotated[str, Field(title="Chunk text, cut to the context budget")]
    vector_rank: Annotated[int | None, Field(title="Rank in the vector leg")] = None
    keyword_rank: Annotated[int | None, Field(title="Rank in the keyword leg")] = None


class SearchResponse(BaseModel):
    query: str
    results: list[SearchResult]
    took_ms: float


def truncate_text(text: str, limit: int) -> str:
    """Cut at the last sentence end within ``limit`` so a result never ends mid-sentence when avoidable."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    ends = [match.end() for match in _SENTENCE_END.finditer(cut) if match.end() > limit // 2]
    return (cut[: ends[-1]] if ends else cut).rstrip() + " …"


class HybridRetriever:
    def __init__(self, store: SearchStore, embedder: Embedder) -> None:
        self._store = store
        self._embedder = embedder

    async def search(self, request: SearchRequest) -> SearchResponse:
        started = time.perf_counter()
        vector_ids, keyword_ids = await asyncio.gather(
            self._vector_leg(request),
            self._store.keyword_leg(query_terms(request.query), LEG_SIZE, request.connection_ids),
        )
        scores: dict[str, float] = {}
        for ranking in (vector_ids, keyword_ids):
            for rank, chunk in enumerate(ranking, start=1):
                scores[chunk] = scores.get(chunk, 0.0) + 1.0 / (RRF_K + rank)
        fused = sorted(scores, key=lambda chunk: (-scores[chunk], chunk))[: request.top_k]
        records = await self._store.chunks(fused)
        vector_rank = {chunk: rank for rank, chunk in enumerate(vector_ids, start=1)}
        keyword_rank = {chunk: rank for rank, chunk in enumerate(keyword_ids, start=1)}
        citations: dict[str, int] = {}
        results: list[SearchResult] = []
        budget = MAX_CALL_CHARS
        for chunk in fused:
            record = records.get(chunk)
            if record is None or budget <= 0:
                continue  # deleted between the legs and the read; the next search will not see it
            text = truncate_text(record.text, min(MAX_RESULT_CHARS, budget))
            budget -= len(text)
            results.append(
                SearchResult(
                    rank=len(results) + 1,
                    score=scores[chunk],
                    citation_index=citations.setdefault(record.document_id, len(citations) + 1),
                    document_id=record.document_id,
                    chunk_id=chunk,
                    connection_id=record.connection_id,
                    title=record.title,
                    source=record.source,
                    heading=record.heading,
                    text=text,
                    vector_rank=vector_rank.get(chunk),
                    keyword_rank=keyword_rank.get(chunk),
                )
            )
        return SearchResponse(
            query=request.query, results=results, took_ms=round((time.perf_counter() - started) * 1000, 2)
        )

    async def _vector_leg(self, request: SearchRequest) -> list[str]:
        table = await self._store.embedding_table(self._embedder.model_key)
        if table is None:
            return []
        vector = (await self._embedder.embed([request.query], kind="query"))[0]
        return await self._store.vector_leg(table, vector, LEG_SIZE, request.connection_ids)
