"""Optional reranking of the fused candidates; any failure falls back to the fused order.

There is no local cross-encoder: no package on PyPI ships reranker weights that load without a
model-hub download, and this project loads nothing from a hub at run time. The remote one is
DashScope's text-rerank API (docs/platform-apis.md §6.3).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Protocol

import httpx

from ragstream.core.errors import ProviderError
from ragstream.embedding._http import ModelApiClient
from ragstream.embedding.base import EmbeddingError
from ragstream.embedding.dashscope import DEFAULT_BASE_URL, parse_native_error
from ragstream.vendor_http import RetryPolicy

__all__ = [
    "MAX_DOCUMENTS",
    "MAX_ITEM_CHARS",
    "MAX_REQUEST_CHARS",
    "RERANK_PATH",
    "DashScopeReranker",
    "RerankError",
    "Reranker",
]

RERANK_PATH = "/api/v1/services/rerank/text-rerank/text-rerank"

#: Documents per request for gte-rerank-v2 and qwen3-rerank (§6.3).
MAX_DOCUMENTS = 500
#: The service truncates a query or document past 4,000 tokens. Characters stand in for tokens
#: because a character is at most about one token (CJK) and usually far less (English), so a
#: character budget never exceeds the token one.
MAX_ITEM_CHARS = 4000
#: gte-rerank-v2 takes 30,000 tokens per request (§6.3; qwen3-rerank may take more). Whether the
#: query counts once or once per document is undocumented, so it is counted per document.
MAX_REQUEST_CHARS = 30_000

_PROVIDER = "dashscope-rerank"


class Reranker(Protocol):
    """Scores candidate texts against the query; returns ``(candidate index, relevance)`` best first."""

    async def rerank(self, query: str, texts: Sequence[str], top_n: int) -> list[tuple[int, float]]: ...

    async def aclose(self) -> None: ...


class RerankError(ProviderError):
    """A rerank request failed or its answer was unusable; the message never carries the key."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class DashScopeReranker:
    """Reranks through DashScope's native text-rerank endpoint.

    Candidates are sent in as few requests as the per-request limits allow (at most
    ``MAX_DOCUMENTS`` documents and ``max_request_chars`` characters each) and the scores merged:
    a cross-encoder scores each (query, document) pair on its own, so scores from different
    requests compare. The defaults retry once and time out quickly because the retriever waits
    only a few seconds for a reranker before it keeps the fused order.
    """

    def __init__(
        self,
        api_key: str,
        model: str = "gte-rerank-v2",
        base_url: str = DEFAULT_BASE_URL,
        timeout_s: float = 5.0,
        max_retries: int = 1,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        max_concurrency: int = 4,
        max_request_chars: int = MAX_REQUEST_CHARS,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 1.0,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        if max_request_chars < 2 * MAX_ITEM_CHARS:
            raise ValueError(f"max_request_chars must be at least {2 * MAX_ITEM_CHARS}")
        self._model = model
        self._max_request_chars = max_request_chars
        # The embedders' client is reused for its retries, concurrency cap and key redaction; its
        # errors are EmbeddingError and become RerankError at this module's edge. A platform's
        # Retry-After is honoured only up to ``backoff_max_s``: the retriever waits seconds, not minutes.
        self._http = ModelApiClient(
            provider=_PROVIDER,
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
            secrets=[api_key],
            parse_error=parse_native_error,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            retry=RetryPolicy(max_retries, backoff_initial_s, backoff_max_s, max_wait_s=backoff_max_s),
            transport=transport,
        )

    async def rerank(self, query: str, texts: Sequence[str], top_n: int) -> list[tuple[int, float]]:
        """The ``top_n`` best of ``texts`` as ``(index into texts, relevance)``, best first."""
        if top_n < 1:
            raise ValueError("top_n must be at least 1")
        if not texts:
            return []
        query = query[:MAX_ITEM_CHARS]
        documents = [text[:MAX_ITEM_CHARS] for text in texts]
        batches = self._batches(len(query), documents)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._rerank_batch(query, documents[start:end], start, min(top_n, end - start)))
                    for start, end in batches
                ]
        except BaseExceptionGroup as failures:
            errors = [e for e in failures.exceptions if isinstance(e, RerankError)]
            if len(errors) != len(failures.exceptions):
                raise
            raise errors[0] from None
        scored = [pair for task in tasks for pair in task.result()]
        # Stable: equal scores keep the fused order the candidates arrived in.
        scored.sort(key=lambda pair: -pair[1])
        return scored[:top_n]

    def _batches(self, query_chars: int, documents: list[str]) -> list[tuple[int, int]]:
        """Consecutive ``[start, end)`` runs within the document and character limits."""
        batches: list[tuple[int, int]] = []
        start, used = 0, 0
        for index, document in enumerate(documents):
            cost = query_chars + len(document)
            if index > start and (index - start >= MAX_DOCUMENTS or used + cost > self._max_request_chars):
                batches.append((start, index))
                start, used = index, 0
            used += cost
        batches.append((start, len(documents)))
        return batches

    async def _rerank_batch(self, query: str, documents: list[str], offset: int, top_n: int) -> list[tuple[int, float]]:
        payload = {
            "model": self._model,
            "input": {"query": query, "documents": documents},
            "parameters": {"top_n": top_n, "return_documents": False},
        }
        try:
            body = await self._http.post_json(RERANK_PATH, payload)
        except EmbeddingError as error:
            raise RerankError(str(error), retryable=error.retryable) from None
        output = body.get("output")
        results = output.get("results") if isinstance(output, dict) else None
        if not isinstance(results, list):
            raise self._malformed("answer has no list of results", body)
        order: list[tuple[int, float]] = []
        seen: set[int] = set()
        for item in results:
            index = item.get("index") if isinstance(item, dict) else None
            score = item.get("relevance_score") if isinstance(item, dict) else None
            # ``index`` is the position in this request's documents; anything else would silently
            # attach one chunk's score to another.
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(documents):
                raise self._malformed(f"answer has index {index!r} outside 0..{len(documents) - 1}", body)
            if index in seen:
                raise self._malformed(f"answer repeats index {index}", body)
            if not isinstance(score, int | float) or isinstance(score, bool) or not math.isfinite(score):
                raise self._malformed(f"result {index} has relevance_score {score!r}", body)
            seen.add(index)
            order.append((offset + index, float(score)))
        return order

    def _malformed(self, reason: str, body: dict[str, object]) -> RerankError:
        error = self._http.malformed(reason, body.get("request_id"))
        return RerankError(str(error), retryable=False)

    async def aclose(self) -> None:
        await self._http.aclose()
