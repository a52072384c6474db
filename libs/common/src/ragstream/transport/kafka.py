"""The Kafka transport: announcements are published to the topics, and the stage services' commits,
deletions and give-ups, read back from PostgreSQL, say when they have settled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from faststream.kafka import KafkaBroker

from ragstream.kafka import KafkaChangeSink
from ragstream.messages import DocumentChanged, DocumentDeleted
from ragstream.storage.downstream import DownstreamStore
from ragstream.transport.base import OnSettled, Settled

__all__ = ["KafkaTransport"]


class _TopicDelivery:
    """Publishes each announcement (acknowledged by Kafka before it returns) and remembers the
    ``(document id, version)`` of every change, which is what settling waits for. While announcing,
    it also reads what has settled so far every ``poll_s``: progress moves during a long listing, and
    the guard can stop a degraded sync before it has announced everything."""

    def __init__(
        self, sink: KafkaChangeSink, downstream: DownstreamStore, on_settled: OnSettled, poll_s: float
    ) -> None:
        self._sink = sink
        self._downstream = downstream
        self._on_settled = on_settled
        self._poll_s = poll_s
        self._announced: list[tuple[str, int]] = []
        self._deletions: list[tuple[str, int]] = []
        self._read_at = time.monotonic()

    async def changed(self, message: DocumentChanged) -> None:
        await self._sink.changed(message)
        self._announced.append((message.header.document_id, message.header.version))
        if time.monotonic() - self._read_at >= self._poll_s:
            await self._read()

    async def deleted(self, message: DocumentDeleted) -> None:
        await self._sink.deleted(message)
        self._deletions.append((message.document_id, message.version))

    async def settle(self) -> Settled:
        """Poll what the indexer committed or deleted and the stages gave up on, until it covers
        every announcement; ``on_settled`` sees each reading, so a run's heartbeat moves only when
        the downstream counts do and a stalled pipeline goes stale."""
        while True:
            if (reading := await self._read()) is not None:
                return reading
            await asyncio.sleep(self._poll_s)

    async def _read(self) -> Settled | None:
        """Read and report what has settled; returned only once it is everything announced."""
        self._read_at = time.monotonic()
        downstream = await self._downstream.downstream(self._announced)
        deleted, deletions_settled = await self._downstream.deletions(self._deletions)
        settled = Settled(
            indexed=downstream.indexed,
            failed=downstream.failed,
            chunks=downstream.chunks,
            deleted=deleted,
            vectors=downstream.indexed,
            missing_vectors=downstream.failed_embedding,
        )
        self._on_settled(settled)
        if downstream.settled(len(self._announced)) and deletions_settled >= len(self._deletions):
            return settled
        return None


class KafkaTransport:
    """Announces to ``doc.changed`` / ``doc.deleted`` through ``broker``; the chunker, embedder and
    indexer services do the work, each retrying, recording and dead-lettering its own failures."""

    def __init__(self, broker: KafkaBroker, downstream: DownstreamStore, *, poll_interval_s: float) -> None:
        self._sink = KafkaChangeSink(broker)
        self._downstream = downstream
        self._poll_s = poll_interval_s

    @asynccontextmanager
    async def open(self, on_settled: OnSettled) -> AsyncIterator[_TopicDelivery]:
        yield _TopicDelivery(self._sink, self._downstream, on_settled, self._poll_s)
