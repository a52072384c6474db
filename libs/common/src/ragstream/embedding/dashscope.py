"""DashScope (Alibaba Cloud Model Studio) embedder over the native text-embedding endpoint.

The native endpoint is used rather than the OpenAI-compatible one because it answers with
``text_index`` per vector (one client saw the batch endpoint repeat index 0, docs/platform-apis.md §6.2)
and because it takes ``text_type``, so queries and documents are embedded as the model expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from ragstream.embedding._http import (
    ErrorInfo,
    ModelApiClient,
    assemble_vectors,
    embed_in_batches,
)
from ragstream.embedding.base import TextKind, Vectors
from ragstream.embedding.coalescing import BatchLimits
from ragstream.vendor_http import RetryPolicy

__all__ = [
    "DEFAULT_BASE_URL",
    "EMBEDDING_PATH",
    "MAX_BATCH_SIZE",
    "DashScopeEmbedder",
    "parse_native_error",
]

DEFAULT_BASE_URL = "https://dashscope.aliyuncs.com"
EMBEDDING_PATH = "/api/v1/services/embeddings/text-embedding/text-embedding"

#: Texts per request for text-embedding-v3/v4 on the current model page. Older pages said 6 or 20
#: (docs/platform-apis.md §6.2, "Conflict"); 10 is what the service enforces today, and a smaller value
#: can still be passed for an account that sees the older limit.
MAX_BATCH_SIZE = 10

_PROVIDER = "dashscope"


def _request_id(response: httpx.Response, body: object) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("request_id"), str):
        return str(body["request_id"])
    header: str | None = response.headers.get("x-request-id") or response.headers.get("x-dashscope-request-id")
    return header


def parse_native_error(response: httpx.Response) -> ErrorInfo:
    """Read ``{"code", "message", "request_id"}``; tolerate a proxy's HTML or an empty body."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return ErrorInfo(
            status=response.status_code,
            code=str(body.get("code") or ""),
            message=str(body.get("message") or response.reason_phrase),
            request_id=_request_id(response, body),
        )
    return ErrorInfo(
        status=response.status_code,
        code="",
        message=response.text[:200] or response.reason_phrase,
        request_id=_request_id(response, None),
    )


class DashScopeEmbedder:
    """Embeds through DashScope in batches of at most 10 texts, a few requests at a time.

    Throttling (429, or a ``Throttling*`` code under any status), 408, 5xx, timeouts and dropped
    connections are retried with jittered exponential backoff, or after the ``Retry-After`` the
    service sent (up to a minute); anything else (bad key, bad parameter, content inspection) fails
    at once because waiting cannot fix it. ``backoff_*`` exist so tests and latency-sensitive
    callers can shrink the waits.
    """

    def __init__(
        self,
        api_key: str,
        model: str = "text-embedding-v3",
        dimension: int = 1024,
        base_url: str = DEFAULT_BASE_URL,
        batch_size: int = MAX_BATCH_SIZE,
        max_concurrency: int = 5,
        timeout_s: float = 30.0,
        max_retries: int = 5,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}")
        if dimension < 1:
            raise ValueError("dimension must be positive")
        self._model = model
        self._dimension = dimension
        self._batch_size = batch_size
        # Requests filled to the batch limit across documents, as many at once as the client allows.
        self.batch_limits = BatchLimits(batch_size=batch_size, max_in_flight=max_concurrency)
        self._http = ModelApiClient(
            provider=_PROVIDER,
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
            secrets=[api_key],
            parse_error=parse_native_error,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            retry=RetryPolicy(max_retries, backoff_initial_s, backoff_max_s),
            transport=transport,
        )

    @property
    def model_key(self) -> str:
        return f"dashscope-{self._model}-{self._dimension}"

    @property
    def dimension(self) -> int:
        return self._dimension

    async def warm_up(self) -> None:
        # Nothing to load: the HTTP client is built on the first request.
        return None

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if kind not in ("document", "query"):
            raise ValueError(f"kind must be 'document' or 'query', not {kind!r}")
        return await embed_in_batches(
            texts,
            batch_size=self._batch_size,
            dimension=self._dimension,
            embed_batch=lambda batch: self._embed_batch(batch, kind),
        )

    async def _embed_batch(self, batch: list[str], kind: TextKind) -> Vectors:
        body = await self._http.post_json(
            EMBEDDING_PATH,
            {
                "model": self._model,
                "input": {"texts": batch},
                "parameters": {
                    "dimension": self._dimension,
                    "text_type": kind,
                    "output_type": "dense",
                },
            },
        )
        output = body.get("output")
        return assemble_vectors(
            output.get("embeddings") if isinstance(output, dict) else None,
            index_key="text_index",
            count=len(batch),
            dimension=self._dimension,
            fail=lambda reason: self._http.malformed(reason, body.get("request_id")),
        )

    async def aclose(self) -> None:
        await self._http.aclose()
