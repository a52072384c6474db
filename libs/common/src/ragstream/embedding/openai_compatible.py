"""Embedder for any server that speaks OpenAI's ``POST /embeddings``: vLLM, TEI, Ollama, DashScope.

Self-hosted servers differ in the small print (TEI sends ``{"error": "…"}``, vLLM a top-level
``message`` with a numeric ``code``, OpenAI and DashScope ``{"error": {"code", "message"}}``), so
the error reader accepts all of them; batching and retries are the same as for the native
DashScope client (``_http``).
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

__all__ = ["OpenAICompatibleEmbedder", "parse_openai_error"]

_PROVIDER = "openai-compatible"


def _first_str(*values: object) -> str | None:
    for value in values:
        if isinstance(value, str) and value:
            return value
    return None


def parse_openai_error(response: httpx.Response) -> ErrorInfo:
    """Read the error from any of the OpenAI-like shapes listed in the module docstring."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return ErrorInfo(
            status=response.status_code,
            code="",
            message=response.text[:200] or response.reason_phrase,
            request_id=response.headers.get("x-request-id"),
        )
    error = body.get("error")
    detail: dict[str, Any] = error if isinstance(error, dict) else body
    code = detail.get("code")
    return ErrorInfo(
        status=response.status_code,
        # A numeric code (vLLM) only repeats the status; the ``type`` then says more.
        code=_first_str(code, detail.get("type"), body.get("error_type")) or "",
        message=_first_str(detail.get("message"), error, body.get("detail")) or response.reason_phrase,
        request_id=_first_str(body.get("request_id"), detail.get("request_id")) or response.headers.get("x-request-id"),
    )


class OpenAICompatibleEmbedder:
    """Embeds through an OpenAI-style ``/embeddings`` route, ordering vectors by ``index``.

    ``dimension`` is what the server is expected to return and is always checked; it is only
    *sent* (as ``dimensions``) when ``send_dimensions`` is set, because many self-hosted servers
    reject the field for models with a fixed size. The API has no query/document switch, so
    models trained with instructions (e5, bge) get them through ``query_prefix`` /
    ``document_prefix``. ``model_key`` defaults to ``openai-compatible-{model}-{dimension}``;
    pass one explicitly when the same vector space is reached through another route (for example
    ``dashscope-text-embedding-v3-1024`` over DashScope's compatible mode).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        dimension: int,
        api_key: str | None = None,
        batch_size: int = 32,
        max_concurrency: int = 4,
        timeout_s: float = 30,
        max_retries: int = 5,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        send_dimensions: bool = False,
        query_prefix: str = "",
        document_prefix: str = "",
        model_key: str | None = None,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if dimension < 1:
            raise ValueError("dimension must be positive")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._model = model
        self._dimension = dimension
        self._batch_size = batch_size
        self.batch_limits = BatchLimits(batch_size=batch_size, max_in_flight=max_concurrency)
        self._send_dimensions = send_dimensions
        self._prefixes: dict[TextKind, str] = {"query": query_prefix, "document": document_prefix}
        self._model_key = model_key or f"{_PROVIDER}-{model}-{dimension}"
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = ModelApiClient(
            provider=_PROVIDER,
            base_url=base_url,
            headers=headers,
            secrets=[api_key] if api_key else [],
            parse_error=parse_openai_error,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            retry=RetryPolicy(max_retries, backoff_initial_s, backoff_max_s),
            transport=transport,
        )

    @property
    def model_key(self) -> str:
        return self._model_key

    @property
    def dimension(self) -> int:
        return self._dimension

    async def warm_up(self) -> None:
        # Nothing to load: the HTTP client is built on the first request.
        return None

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if kind not in self._prefixes:
            raise ValueError(f"kind must be 'document' or 'query', not {kind!r}")
        prefix = self._prefixes[kind]
        prepared = [prefix + text for text in texts] if prefix else list(texts)
        return await embed_in_batches(
            prepared,
            batch_size=self._batch_size,
            dimension=self._dimension,
            embed_batch=self._embed_batch,
        )

    async def _embed_batch(self, batch: list[str]) -> Vectors:
        payload: dict[str, Any] = {"model": self._model, "input": batch, "encoding_format": "float"}
        if self._send_dimensions:
            payload["dimensions"] = self._dimension
        body = await self._http.post_json("/embeddings", payload)
        request_id = _first_str(body.get("request_id"), body.get("id"))
        return assemble_vectors(
            body.get("data"),
            index_key="index",
            count=len(batch),
            dimension=self._dimension,
            fail=lambda reason: self._http.malformed(reason, request_id),
        )

    async def aclose(self) -> None:
        await self._http.aclose()
