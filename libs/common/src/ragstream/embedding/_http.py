"""HTTP machinery shared by the remote embedders: batching, a concurrency cap, retries, vector checks.

Each provider module only knows its wire format (request body, where the vectors and the error code
sit); everything about *how* requests are sent — how many at once, which failures are worth another
attempt, how long to back off, and how to turn the answer into unit vectors — lives here once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import orjson
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from ragstream.embedding.base import EmbeddingError, Vectors
from ragstream.vendor_http import build_client

__all__ = [
    "PERMANENT_CODES",
    "THROTTLING_CODES",
    "ErrorInfo",
    "ErrorParser",
    "RemoteEmbeddingClient",
    "RetryPolicy",
    "TransientError",
    "assemble_vectors",
    "decode_json",
    "embed_in_batches",
    "is_retryable",
    "redact",
    "split_batches",
]

logger = logging.getLogger(__name__)

#: Codes that mean "slow down", not "this request is wrong". DashScope sends ``Throttling.RateQuota``
#: with HTTP 429 *and* with HTTP 400 (docs/platform-apis.md §6.4), so the decision keys on the code first.
THROTTLING_CODES = frozenset(
    {"Throttling", "Throttling.RateQuota", "Throttling.AllocationQuota", "rate_limit_exceeded"}
)

#: Codes that arrive with a retryable status but will not get better by waiting (OpenAI sends an
#: exhausted billing quota as 429 ``insufficient_quota``; retrying it only delays the real error).
PERMANENT_CODES = frozenset({"insufficient_quota", "Arrearage"})

_RETRYABLE_STATUSES = frozenset({408, 425, 429})

_REDACTED = "***"


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


class TransientError(Exception):
    """A failure worth another attempt (throttling, 5xx, timeout, dropped connection).

    Internal to the retry loop: once the attempts run out it becomes an
    ``EmbeddingError(retryable=True)`` so callers only ever see the public error type.
    """


def is_retryable(info: ErrorInfo) -> bool:
    """Decide on the code before the status: a throttling code is retried even under HTTP 400."""
    if info.code in PERMANENT_CODES:
        return False
    if info.code in THROTTLING_CODES or info.code.startswith("Throttling."):
        return True
    return info.status in _RETRYABLE_STATUSES or info.status >= 500


def redact(text: str, secrets: Iterable[str]) -> str:
    """Blank out secrets that a server echoed back ("Incorrect API key provided: sk-…")."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, _REDACTED)
    return text


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry one request.

    ``max_retries`` counts retries after the first attempt. The wait doubles from
    ``backoff_initial_s`` up to ``backoff_max_s`` with up to ``backoff_initial_s`` of random jitter,
    so many workers throttled at the same moment do not come back in lockstep.
    """

    max_retries: int = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must not be negative")
        if self.backoff_initial_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff times must not be negative")

    def retrying(self, before_sleep: Callable[[RetryCallState], None]) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=wait_exponential_jitter(
                multiplier=self.backoff_initial_s,
                max=self.backoff_max_s,
                jitter=self.backoff_initial_s,
            ),
            retry=retry_if_exception_type(TransientError),
            before_sleep=before_sleep,
            reraise=True,
        )


class RemoteEmbeddingClient:
    """One provider connection: a lazily built ``httpx.AsyncClient``, a semaphore, a retry policy.

    The semaphore caps requests *in flight* across every concurrent ``embed`` call on the same
    embedder, and is taken per attempt: a request sleeping in backoff holds no slot, so it does not
    stop healthy batches from using the connection.
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
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.provider = provider
        self._base_url = base_url.rstrip("/")
        self._headers = headers
        self._secrets = tuple(s for s in secrets if s)
        self._parse_error = parse_error
        self._timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        self._retry = retry
        self._transport = transport
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        # Built on first use rather than in __init__ so constructing an embedder (config loading,
        # CLI help) never opens a connection pool that nobody closes.
        if self._client is None:
            self._client = build_client(
                base_url=self._base_url,
                timeout_s=self._timeout_s,
                headers=self._headers,
                max_connections=self._max_concurrency,
                transport=self._transport,
            )
        return self._client

    def redact(self, text: str) -> str:
        return redact(text, self._secrets)

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
            async for attempt in self._retry.retrying(self._log_retry):
                with attempt:
                    return await self._post_once(path, payload)
        except TransientError as exc:
            attempts = self._retry.max_retries + 1
            raise self.error(f"gave up after {attempts} attempt(s): {exc}", retryable=True) from None
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def _post_once(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        async with self._semaphore:
            try:
                response = await self._http().post(path, json=payload)
            except httpx.TimeoutException as exc:
                raise TransientError(f"timed out after {self._timeout_s}s ({type(exc).__name__})") from None
            except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                raise TransientError(f"connection failed ({type(exc).__name__}: {exc})") from None
        if response.is_success:
            return self._decode(response)
        info = self._parse_error(response)
        info = ErrorInfo(info.status, info.code, self.redact(info.message), info.request_id)
        if is_retryable(info):
            raise TransientError(info.describe())
        # ``from None``: the httpx response/request objects carry the Authorization header and
        # have no business in a traceback that ends up in the failed-items table.
        raise self.error(info.describe(), retryable=False) from None

    def _decode(self, response: httpx.Response) -> dict[str, Any]:
        body = decode_json(response)
        if not isinstance(body, dict):
            raise self.error(f"HTTP {response.status_code} answer is not a JSON object", retryable=False) from None
        return body

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        logger.warning(
            "%s: attempt %d failed (%s); retrying in %.2fs",
            self.provider,
            state.attempt_number,
            self.redact(str(exc)),
            delay,
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


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
