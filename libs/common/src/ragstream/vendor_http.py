"""Outbound HTTP to vendors: the one client factory, and the pacing, retries and redaction connectors share.

A platform module knows its wire format (paths, envelope, which codes mean "throttled", "denied" or
"gone"); how requests are sent lives here once:

- ``build_client`` is the only place an ``httpx.AsyncClient`` is made (connectors, embedders and the
  reranker alike), so an outbound guard (a transport) applies to every vendor by being set here.
- ``PacingWindow``: at most N calls in any window, per API group, with a margin for latency jitter;
  ``max_in_flight`` caps the requests under way at once (a model API's concurrency quota).
- ``VendorHttp.retrying``: ``Transient`` failures (throttled, 5xx, timeouts, dropped connections) are
  retried with jittered exponential backoff, or after the platform's own wait (``Retry-After`` or a
  vendor reset header, see ``retry_after``) when it gave one; other failures are raised at once.
- Secrets never reach a message: ``redact`` blanks them in server text, and httpx errors are never
  chained, since their request objects carry the credential headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from ragstream import outbound
from ragstream.metrics import VENDOR_REQUEST_SECONDS, VENDOR_REQUESTS

__all__ = [
    "PacingWindow",
    "RateLimit",
    "RetryPolicy",
    "Transient",
    "VendorError",
    "VendorHttp",
    "build_client",
    "json_body",
    "redact",
    "retry_after",
]

logger = logging.getLogger(__name__)

_REDACTED = "***"

#: The client counts calls when it sends them, the platform when they arrive: latency jitter can
#: bunch arrivals closer than departures, so the client's window is this much longer than documented.
PACING_MARGIN = 1.2

#: A reset header above this is a Unix time, not a number of seconds (2001-09-09).
_EPOCH_THRESHOLD = 1_000_000_000

T = TypeVar("T")


class VendorError(Exception):
    """What a platform answered (``status``, its own ``code``), without any secret. ``retryable``: a
    later attempt may succeed unchanged. Subclasses keep this constructor: the retry loop rebuilds
    the last error with "gave up after N attempts"."""

    def __init__(
        self, message: str, *, status: int | None = None, code: int | str | None = None, retryable: bool
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retryable = retryable


class Transient(Exception):
    """Internal to the retry loop: ``error`` is raised once the attempts run out; ``retry_after`` is
    the platform's own wait, when it said one."""

    def __init__(self, error: VendorError, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``requests`` calls in any ``per_s`` seconds."""

    requests: int
    per_s: float


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries after the first attempt, and the jittered exponential backoff between them. A throttled
    call waits what the platform says instead, up to ``max_wait_s``."""

    max_retries: int = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must not be negative")
        if min(self.backoff_initial_s, self.backoff_max_s, self.max_wait_s) < 0:
            raise ValueError("backoff and wait times must not be negative")


class PacingWindow:
    """A sliding window: ``acquire`` waits until one more call fits in ``limit`` (with the margin)."""

    def __init__(self, limit: RateLimit) -> None:
        self._requests = limit.requests
        self._period_s = limit.per_s * PACING_MARGIN
        self._calls: deque[float] = deque()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                while self._calls and now - self._calls[0] >= self._period_s:
                    self._calls.popleft()
                if len(self._calls) < self._requests:
                    self._calls.append(now)
                    return
                await asyncio.sleep(self._period_s - (now - self._calls[0]))


def build_client(
    *,
    base_url: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    max_connections: int | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """The one factory of vendor HTTP clients: every request passes the outbound gate
    (:mod:`ragstream.outbound`: http(s) only, no private addresses unless allowed, redirects included).
    ``max_connections`` caps the pool (and its keep-alive connections); ``transport`` replaces the
    network below the gate (a test's mock)."""
    limits = (
        httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        if max_connections is not None
        else httpx.Limits()
    )
    return outbound.client(
        base_url=base_url,
        timeout=httpx.Timeout(timeout_s),
        headers=dict(headers or {}),
        limits=limits,
        transport=transport,
    )


def redact(text: str, secrets: Iterable[str]) -> str:
    """Blank out secrets that a server echoed back."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, _REDACTED)
    return text


def retry_after(response: httpx.Response, *reset_headers: str) -> float | None:
    """Seconds the platform asks to wait: ``Retry-After`` (seconds or an HTTP date), else the first
    of ``reset_headers`` present, read as seconds or, when it is that large, as a Unix time."""
    value = response.headers.get("retry-after")
    if value is not None:
        try:
            return max(float(value), 0.0)
        except ValueError:
            try:
                return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
            except (TypeError, ValueError):
                pass
    for name in reset_headers:
        try:
            seconds = float(response.headers[name])
        except (KeyError, ValueError):
            continue
        if seconds > _EPOCH_THRESHOLD:
            seconds -= time.time()
        return max(seconds, 0.0)
    return None


def json_body(response: httpx.Response) -> dict[str, Any]:
    """The response's JSON object, or ``{}`` for anything else (error pages, empty bodies)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class VendorHttp:
    """One platform's HTTP pool, opened on first use and closed by ``aclose``, with pacing per API
    group and the retry loop. ``secrets`` is asked for the values to redact at each message, so
    tokens issued later are covered too; ``error_type`` is the platform's ``VendorError`` subclass
    that network failures are raised as. ``max_in_flight`` caps the requests under way at once, and
    the pool with them; a slot is held per attempt, so a call sleeping in backoff holds none."""

    def __init__(
        self,
        vendor: str,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        limits: Mapping[str, RateLimit] | None = None,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        secrets: Callable[[], Iterable[str]] = tuple,
        error_type: type[VendorError] = VendorError,
        max_in_flight: int | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.vendor = vendor
        self.error_type = error_type
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._headers = dict(headers or {})
        self._windows = {group: PacingWindow(limit) for group, limit in (limits or {}).items()}
        self._transport = transport
        self._secrets = secrets
        self._max_in_flight = max_in_flight
        self._in_flight = asyncio.Semaphore(max_in_flight) if max_in_flight is not None else None
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        # Built on first use rather than in __init__, so that building a connector or an embedder (config
        # loading, CLI help) never opens a pool that nobody closes.
        if self._client is None:
            self._client = build_client(
                base_url=self.base_url,
                timeout_s=self.timeout_s,
                headers=self._headers,
                max_connections=self._max_in_flight,
                transport=self._transport,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def redact(self, text: str) -> str:
        return redact(text, self._secrets())

    async def pace(self, group: str) -> None:
        """Wait for room in ``group``'s window; a group without a limit is not paced."""
        window = self._windows.get(group)
        if window is not None:
            await window.acquire()

    async def send(self, method: str, path: str, *, auth: httpx.Auth | None = None, **kwargs: Any) -> httpx.Response:
        """One request, in one of the ``max_in_flight`` slots; a timeout or a dropped connection becomes
        a retryable ``Transient``. The request is built (its body encoded) before it waits for a slot,
        so that a slot is held only while the request is on the wire; ``kwargs`` are ``build_request``'s."""
        request = self.client().build_request(method, path, **kwargs)
        if self._in_flight is None:
            return await self._send(request, path, auth)
        async with self._in_flight:
            return await self._send(request, path, auth)

    async def _send(self, request: httpx.Request, path: str, auth: httpx.Auth | None) -> httpx.Response:
        outcome, started = "error", time.perf_counter()
        try:
            response = await self.client().send(request, auth=auth)
            outcome = f"{response.status_code // 100}xx"
            return response
        except httpx.TimeoutException as error:
            outcome = "timeout"
            message = f"{path}: timed out after {self.timeout_s}s ({type(error).__name__})"
            raise Transient(self.error_type(message, retryable=True)) from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as error:
            outcome = "network"
            failed = f"{path}: connection failed ({type(error).__name__})"
            raise Transient(self.error_type(failed, retryable=True)) from None
        finally:
            VENDOR_REQUEST_SECONDS.labels(self.vendor).observe(time.perf_counter() - started)
            VENDOR_REQUESTS.labels(self.vendor, outcome).inc()

    async def retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``call`` until it returns, raises a non-transient error, or the attempts run out; then the
        last error is raised as its own type, marked retryable."""
        policy = self.retry
        exponential = wait_exponential_jitter(
            multiplier=policy.backoff_initial_s, max=policy.backoff_max_s, jitter=policy.backoff_initial_s
        )

        def wait(state: RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome is not None else None
            if isinstance(error, Transient) and error.retry_after is not None:
                return min(error.retry_after, policy.max_wait_s)
            return float(exponential(state))

        def log(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            attempt = state.attempt_number
            logger.warning("%s: %s attempt %d failed (%s); retrying in %.2fs", self.vendor, what, attempt, error, delay)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.max_retries + 1),
            wait=wait,
            retry=retry_if_exception_type(Transient),
            before_sleep=log,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await call()
        except Transient as error:
            inner = error.error
            raise type(inner)(
                f"{inner} (gave up after {policy.max_retries + 1} attempts)",
                status=inner.status,
                code=inner.code,
                retryable=True,
            ) from None
        raise AssertionError("unreachable: tenacity either returns or re-raises")
