"""Admission control of searches: one limiter shared by the HTTP and gRPC APIs of a process, and
the count of their outcomes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Literal

from ragstream.core.errors import Unavailable
from ragstream.metrics import ADMISSION_REJECTIONS, SEARCH_REQUESTS
from ragstream.settings import Settings
from ragstream.storage.database import DatabaseBusy

__all__ = ["Overloaded", "SearchAdmission", "counted_search"]


class Overloaded(Unavailable):
    """No turn for this search: too many waiting already, or the wait for a turn timed out. The API
    answers 503 with ``Retry-After: retry_after_s`` (gRPC: RESOURCE_EXHAUSTED)."""

    code = "overloaded"
    public_reason = "too many searches at once"

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class SearchAdmission:
    """At most ``max_in_flight`` searches run at once; up to ``max_waiting`` more wait for a turn,
    each at most ``wait_timeout_s``; any other is refused at once with :class:`Overloaded`.

    Searches beyond what the pool and the CPU serve would only queue inside the pool, where every
    caller waits without bound of count and the client times out first; refused early, a caller
    learns it cheaply and can retry elsewhere or later.
    """

    def __init__(self, max_in_flight: int, max_waiting: int, wait_timeout_s: float, *, retry_after_s: int = 1) -> None:
        if max_in_flight < 1 or max_waiting < 0 or wait_timeout_s <= 0:
            raise ValueError("admission needs max_in_flight >= 1, max_waiting >= 0 and wait_timeout_s > 0")
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.wait_timeout_s = wait_timeout_s
        self.retry_after_s = retry_after_s
        self._turns = asyncio.Semaphore(max_in_flight)
        self._waiting = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> SearchAdmission:
        """The limits of ``settings.search_limits``; unset ones follow the pool size, leaving two
        connections to readiness checks, syncs and the control plane."""
        limits = settings.search_limits
        in_flight = limits.max_in_flight or max(1, settings.db_pool_size - 2)
        waiting = limits.max_waiting if limits.max_waiting is not None else 16 * in_flight
        return cls(in_flight, waiting, limits.wait_timeout_s)

    @property
    def waiting(self) -> int:
        """Searches waiting for a turn now."""
        return self._waiting

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """A turn for the block: at once when one is free, else after a bounded wait, else
        :class:`Overloaded`."""
        if self._turns.locked():
            if self._waiting >= self.max_waiting:
                ADMISSION_REJECTIONS.labels("queue_full").inc()
                raise Overloaded(f"{self._waiting} searches are waiting already", self.retry_after_s)
            self._waiting += 1
            try:
                async with asyncio.timeout(self.wait_timeout_s):
                    await self._turns.acquire()
            except TimeoutError:
                ADMISSION_REJECTIONS.labels("wait_timeout").inc()
                raise Overloaded(f"no turn within {self.wait_timeout_s} s", self.retry_after_s) from None
            finally:
                self._waiting -= 1
        else:
            await self._turns.acquire()
        try:
            yield
        finally:
            self._turns.release()


def _outcome(error: BaseException) -> str:
    if isinstance(error, Overloaded):
        return "overloaded"
    if isinstance(error, DatabaseBusy):  # before TimeoutError, which it is
        return "db_busy"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    return "error"


@contextmanager
def counted_search(api: Literal["http", "grpc"]) -> Iterator[None]:
    """Count the search call run in the block in ``ragstream_search_requests_total``, by ``api`` and
    by how it ended: ``ok``, or the error it raised (which goes on)."""
    try:
        yield
    except BaseException as error:
        SEARCH_REQUESTS.labels(api, _outcome(error)).inc()
        raise
    SEARCH_REQUESTS.labels(api, "ok").inc()
