"""Direct search: the live search of every RAG-off connection in scope, concurrently, each in its time.

A connection whose platform is slow or fails (or whose credentials cannot be read) is left out and
reported as a ``DegradedPlatform``; it never fails the search. Hits are filtered by what a live hit
can be checked for: its ACL (as a chunk's, unless the connection skips ACLs), the knowledge-base and
source filters; a metadata filter matches no live hit (they carry none).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime

from ragstream.core.search import DegradedPlatform, SearchRequest
from ragstream.direct.base import LiveHit, PlatformSearcher
from ragstream.direct.registry import DIRECT_PLATFORMS, searcher_for
from ragstream.storage.direct_connections import DirectConnection, DirectConnectionStore
from ragstream.vendor_http import RetryPolicy, VendorError

__all__ = ["DIRECT_RETRY", "DirectOutcome", "DirectSearch", "LiveResults"]

logger = logging.getLogger(__name__)

#: A live search is waited for by a person: one quick retry of a transient failure, no long waits.
DIRECT_RETRY = RetryPolicy(max_retries=1, backoff_initial_s=0.2, backoff_max_s=1.0, max_wait_s=2.0)


@dataclass(frozen=True, slots=True)
class LiveResults:
    """One connection's visible hits, best first."""

    connection: DirectConnection
    hits: list[LiveHit]


@dataclass(frozen=True, slots=True)
class DirectOutcome:
    results: list[LiveResults] = field(default_factory=list)
    degraded: list[DegradedPlatform] = field(default_factory=list)


class DirectSearch:
    """Searchers are kept per connection (a DingTalk token lives two hours) and rebuilt when the
    connection's row changed; ``aclose`` closes them all."""

    def __init__(
        self, store: DirectConnectionStore, *, timeout_s: float = 30.0, retry: RetryPolicy | None = None
    ) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._retry = retry or DIRECT_RETRY
        self._searchers: dict[str, tuple[datetime, PlatformSearcher]] = {}

    async def search(self, request: SearchRequest) -> DirectOutcome:
        if request.filters.metadata:
            return DirectOutcome()
        connections = await self._store.in_scope(request.filters, DIRECT_PLATFORMS)
        answers = await asyncio.gather(*(self._search_one(connection, request) for connection in connections))
        return DirectOutcome(
            [answer for answer in answers if isinstance(answer, LiveResults)],
            [answer for answer in answers if isinstance(answer, DegradedPlatform)],
        )

    async def aclose(self) -> None:
        searchers = [searcher for _, searcher in self._searchers.values()]
        self._searchers.clear()
        await asyncio.gather(*(searcher.aclose() for searcher in searchers), return_exceptions=True)

    async def _search_one(self, connection: DirectConnection, request: SearchRequest) -> LiveResults | DegradedPlatform:
        def degraded(reason: str) -> DegradedPlatform:
            logger.warning("direct search of connection %s (%s): %s", connection.id, connection.platform, reason)
            return DegradedPlatform(connection_id=connection.id, platform=connection.platform, reason=reason)

        if connection.unreadable is not None:
            return degraded(connection.unreadable)
        try:
            searcher = await self._searcher(connection)
        except ValueError as error:
            return degraded(str(error))
        try:
            async with asyncio.timeout(self._timeout_s):
                hits = await searcher.search(request.query, request.top_k)
        except TimeoutError:
            return degraded(f"no answer within {self._timeout_s:g}s")
        except VendorError as error:
            return degraded(str(error))
        except Exception as error:  # a platform's surprise must not fail everyone's search
            logger.exception("direct search of connection %s failed unexpectedly", connection.id)
            return degraded(f"failed: {type(error).__name__}")
        return LiveResults(connection, [hit for hit in hits if _visible(hit, connection, request)])

    async def _searcher(self, connection: DirectConnection) -> PlatformSearcher:
        cached = self._searchers.get(connection.id)
        if cached is not None and cached[0] == connection.updated_at:
            return cached[1]
        searcher = searcher_for(
            connection.platform,
            connection.id,
            connection.name,
            connection.config,
            connection.credentials,
            timeout_s=self._timeout_s,
            retry=self._retry,
        )
        self._searchers[connection.id] = (connection.updated_at, searcher)
        if cached is not None:  # the row changed (new credentials, config): the old pool goes
            await cached[1].aclose()
        return searcher


def _visible(hit: LiveHit, connection: DirectConnection, request: SearchRequest) -> bool:
    filters = request.filters
    if filters.knowledge_bases is not None and hit.knowledge_base not in filters.knowledge_bases:
        return False
    if filters.sources is not None and (hit.url or hit.external_id) not in filters.sources:
        return False
    if connection.skip_acl or hit.acl is None:
        return True
    principals = request.principal.principals() if request.principal else []
    return bool(set(hit.acl) & set(principals))
