"""Scheduled incremental syncs: one leader across replicas enqueues the connections that are due.

Leadership is a session-level ``pg_try_advisory_lock`` held on a dedicated connection (not a pooled
one: the pool would reset it, and a dropped pooled connection is hard to tell from a released one)
for as long as this process leads. If the process dies or its connection drops, PostgreSQL releases the
lock and a follower, which keeps trying, takes over. The leader only enqueues; runners claim the
queued runs within the concurrency limit, so a slow sync never delays the schedule of others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import asyncpg

from ragstream.storage.runs import (
    CONNECTION_ERRORS,
    RagDisabled,
    Run,
    RunInProgress,
    RunStore,
    still_leading,
    try_lead,
)

__all__ = ["SCHEDULER_LOCK", "Scheduler"]

logger = logging.getLogger(__name__)

# The advisory lock key of the scheduler leader; the same in every replica.
SCHEDULER_LOCK = 0x72736368


class Scheduler:
    def __init__(
        self,
        dsn: str,
        runs: RunStore,
        *,
        interval_s: float = 30.0,
        on_enqueued: Callable[[], None] | None = None,
    ) -> None:
        self._dsn = dsn
        self._runs = runs
        self._interval_s = interval_s
        self._on_enqueued = on_enqueued
        self._lock: asyncpg.Connection | None = None

    @property
    def is_leader(self) -> bool:
        return self._lock is not None

    async def run(self) -> None:
        """Step every ``interval_s`` until cancelled, then give up leadership."""
        try:
            while True:
                try:
                    await self.step()
                except CONNECTION_ERRORS as error:
                    logger.warning("scheduler step failed, leadership dropped: %s", error)
                    await self.stop()
                await asyncio.sleep(self._interval_s)
        finally:
            await self.stop()

    async def step(self) -> list[Run]:
        """Become (or check that we still are) the leader; as leader, enqueue the due connections."""
        if self._lock is not None and not await still_leading(self._lock):
            await self.stop()
        if self._lock is None:
            await self._try_lead()
        if self._lock is None:
            return []
        # Runs whose owner died are failed now, not at the stale timeout, even if no one asks.
        await self._runs.reap()
        enqueued = []
        for connection_id in await self._runs.due():
            # A sync on request got there first, or RAG was switched off since due() read it.
            with contextlib.suppress(RunInProgress, RagDisabled):
                enqueued.append(await self._runs.start(connection_id, "schedule"))
        if enqueued and self._on_enqueued is not None:
            self._on_enqueued()
        return enqueued

    async def _try_lead(self) -> None:
        self._lock = await try_lead(self._dsn, SCHEDULER_LOCK)
        if self._lock is not None:
            logger.info("this process now schedules syncs")

    async def stop(self) -> None:
        """Give up leadership, so a follower takes over at its next step."""
        connection, self._lock = self._lock, None
        if connection is None:
            return
        # Closing the session releases its advisory lock.
        with contextlib.suppress(*CONNECTION_ERRORS):
            await connection.close()
