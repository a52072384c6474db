"""The model APIs' side of vendor HTTP: error bodies, which failures are worth another attempt, batching
and vector checks, over ``ragstream.vendor_http`` (the one client connectors use too).

Each provider module only knows its wire format (request body, where the vectors and the error code
sit); how requests are sent (how many at once, the retry loop with the platform's ``Retry-After``,
timeouts, redaction) is ``VendorHttp``'s, and turning an answer into unit vectors lives here once.
The embedders, the reranker and the chat client each send through a ``ModelApiClient``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import orjson

from ragstream.embedding.base import EmbeddingError, Vectors
from ragstream.outbound import OutboundRefused, UnresolvableHost
from ragstream.vendor_http import RetryPolicy, Transient, VendorError, VendorHttp, retry_after

__all__ = [
    "PERMANENT_CODES",
    "THROTTLING_CODES",
    "ErrorInfo",
    "ErrorParser",
    "ModelApiClient",
    "assemble_vectors",
    "decode_json",
    "embed_in_batches",
    "is_retryable",
    "split_batches",
]

#: Codes that mean "slow down", not "this request is wrong". DashScope sends ``Throttling.RateQuota``
#: with HTTP 429 *and* with HTTP 400 (docs/platform-apis.md §6.4), so the decision keys on the code first.
THROTTLING_CODES = frozenset(
    {"Throttling", "Throttling.RateQuota", "Throttling.AllocationQuota", "rate_limit_exceeded"}
)

#: Codes that arrive with a retryable status but will not get better by waiting (OpenAI sends an
#: exhausted billing quota as 429 ``insufficient_quota``; retrying it only delays the real error).
PERMANENT_CODES = frozenset({"insufficient_quota", "Arrearage"})

_RETRYABLE_STATUSES = frozenset({408, 425, 429})


@dataclass(frozen=True)
class ErrorInfo:
    """What a provider said about a failed request, already stripped of secrets."""

    status: int
    code: str
    message: str
    request_id: str | None = None

    def describe(self) -> str:
        request = f" (request_id={self.request_id})" if self.request_id else ""
        return f"HTTP {self.status} {self.code or 'unknown'}: {self.message}{request}"


#: Reads a provider's error body; each provider puts ``code``/``message`` somewhere else.
ErrorParser = Callable[[httpx.Response], ErrorInfo]


def is_retryable(info: ErrorInfo) -> bool:
    """Decide on the code before the status: a throttling code is retried even under HTTP 400."""
    if info.code in PERMANENT_CODES:
        return False
    if info.code in THROTTLING_CODES or info.code.startswith("Throttling."):
        return True
    return info.status in _RETRYABLE_STATUSES or info.status >= 500


class ModelApiClient:
    """One model API connection: JSON posts through a ``VendorHttp`` (pool opened on first use, at most
    ``max_concurrency`` requests in flight across every concurrent call, the retry loop), with the
    provider's error body read into an ``EmbeddingError`` that never carries a secret.
    """

    def __init__(
        self,
        *,
        provider: str,
        base_url: str,
        headers: dict[str, str],
        secrets: Sequence[str],
        parse_error: ErrorParser,
        timeout_s: float,
        max_concurrency: int,
        retry: RetryPolicy,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.provider = provider
        self._parse_error = parse_error
        known = tuple(secret for secret in secrets if secret)
        self._http = VendorHttp(
            provider,
            base_url,
            timeout_s=timeout_s,
            headers=headers,
            retry=retry,
            transport=transport,
            secrets=lambda: known,
            max_in_flight=max_concurrency,
        )

    def redact(self, text: str) -> str:
        return self._http.redact(text)

    def error(self, message: str, *, retryable: bool) -> EmbeddingError:
        """Build the public error, prefixed with the provider and never carrying a secret."""
        return EmbeddingError(self.redact(f"{self.provider}: {message}"), retryable=retryable, provider=self.provider)

    def malformed(self, reason: str, request_id: object) -> EmbeddingError:
        """A 2xx answer that cannot be used.

        Permanent: the same request gets the same answer, and a dimension mismatch means the
        configuration is wrong, not the moment.
        """
        suffix = f" (request_id={request_id})" if request_id else ""
        return self.error(f"{reason}{suffix}", retryable=False)

    async def post_json(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST ``payload`` with retries; return the decoded JSON object of a 2xx answer."""
        try:
            return await self._http.retrying(lambda: self._post_once(path, payload), path)
        except VendorError as error:
            raise self.error(str(error), retryable=error.retryable) from None
        except OutboundRefused as error:
            # The endpoint is the operator's configuration, not the caller's input: a provider failure,
            # retryable when the name did not resolve (DNS may answer later).
            raise self.error(f"{path}: {error}", retryable=isinstance(error, UnresolvableHost)) from None

    async def _post_once(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        response = await self._http.send("POST", path, json=payload)
        if response.is_success:
            return self._decode(response)
        info = self._parse_error(response)
        info = ErrorInfo(info.status, info.code, self.redact(info.message), info.request_id)
        error = VendorError(info.describe(), status=info.status, code=info.code, retryable=is_retryable(info))
        if error.retryable:
            raise Transient(error, retry_after(response))
        # ``from None``: the httpx response/request objects carry the Authorization header and
        # have no business in a traceback that ends up in the failed-items table.
        raise error from None

    def _decode(self, response: httpx.Response) -> dict[str, Any]:
        body = decode_json(response)
        if not isinstance(body, dict):
            raise self.error(f"HTTP {response.status_code} answer is not a JSON object", retryable=False) from None
        return body

    async def aclose(self) -> None:
        await self._http.aclose()


def decode_json(response: httpx.Response) -> object:
    """The answer's JSON, or None. orjson first: ten 1,024-d vectors decode in ~0.6 ms instead of the
    standard library's ~3.5, on the path of every request; what it refuses (a non-UTF-8 charset, the
    ``NaN`` a sloppy server sends, which ``assemble_vectors`` then names) goes to the standard parser."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        pass
    try:
        return response.json()
    except ValueError:
        return None


def split_batches(texts: Sequence[str], batch_size: int) -> list[list[str]]:
    """Cut ``texts`` into consecutive runs of at most ``batch_size`` (the provider's per-call cap)."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    return [list(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]


async def embed_in_batches(
    texts: Sequence[str],
    *,
    batch_size: int,
    dimension: int,
    embed_batch: Callable[[list[str]], Coroutine[Any, Any, Vectors]],
) -> Vectors:
    """Embed every batch concurrently (the client's semaphore does the pacing) and stack in order.

    A ``TaskGroup`` cancels the remaining batches as soon as one fails for good: half an answer is
    useless to the caller and the other requests would only burn quota.
    """
    batches = split_batches(texts, batch_size)
    if not batches:
        return np.zeros((0, dimension), dtype=np.float32)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(embed_batch(batch)) for batch in batches]
    except BaseExceptionGroup as failures:
        errors = [e for e in failures.exceptions if isinstance(e, EmbeddingError)]
        if len(errors) != len(failures.exceptions):
            raise
        # Report a permanent failure over a transient one: retrying the whole item later cannot
        # fix a rejected input, so the caller should learn that first.
        errors.sort(key=lambda e: e.retryable)
        raise errors[0] from None
    return np.vstack([task.result() for task in tasks])


def assemble_vectors(
    items: object,
    *,
    index_key: str,
    count: int,
    dimension: int,
    fail: Callable[[str], EmbeddingError],
) -> Vectors:
    """Place ``[{index_key: i, "embedding": [...]}, ...]`` by index, check it, scale to unit length.

    Providers are trusted for nothing: list position is ignored (a shuffled answer must not swap
    vectors between chunks), duplicate or missing indexes and a wrong dimension are errors rather
    than silently misfiled vectors, and a zero vector stays zero instead of becoming NaN.
    """
    if not isinstance(items, list):
        raise fail("answer has no list of embeddings")
    if len(items) != count:
        raise fail(f"answer has {len(items)} vectors for {count} texts")
    indexes: list[int] = []
    seen: set[int] = set()
    embeddings: list[list[Any]] = []
    for item in items:
        index = item.get(index_key) if isinstance(item, dict) else None
        embedding = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise fail(f"answer has {index_key} {index!r} outside 0..{count - 1}")
        if index in seen:
            raise fail(f"answer repeats {index_key} {index}")
        if not isinstance(embedding, list) or len(embedding) != dimension:
            got = len(embedding) if isinstance(embedding, list) else type(embedding).__name__
            raise fail(f"vector {index} has dimension {got}, expected {dimension}")
        indexes.append(index)
        seen.add(index)
        embeddings.append(embedding)
    out = np.zeros((count, dimension), dtype=np.float32)
    if not count:
        return out
    try:
        rows = np.array(embeddings, dtype=np.float32)  # one conversion for the whole answer
    except (TypeError, ValueError):
        rows = None
    if rows is None or rows.shape != out.shape:
        raise fail(f"vector {indexes[_first_unreadable(embeddings, dimension)]} is not a list of numbers")
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        raise fail(f"vector {indexes[int(np.argmin(finite))]} contains NaN or infinity")
    out[indexes] = rows
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    np.divide(out, norms, out=out, where=norms > 0)
    return out


def _first_unreadable(embeddings: list[list[Any]], dimension: int) -> int:
    """The position of the first embedding that is not a list of ``dimension`` numbers."""
    for position, embedding in enumerate(embeddings):
        try:
            if np.asarray(embedding, dtype=np.float32).shape != (dimension,):
                return position
        except (TypeError, ValueError):
            return position
    raise AssertionError("unreachable: the answer as a whole was not numbers, so one of them is not")
