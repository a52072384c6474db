"""The transport port of the sync job: announce changes and deletions, then await them settled.

The job above it (``ragstream.jobs.sync``) owns what must behave the same in both modes: the
embedding-degradation guard, deletions last, the cursors and the progress; a transport only carries
the announced work to the stages and reports what they made of it (``Settled``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from ragstream.messages import DocumentChanged, DocumentDeleted

__all__ = ["Delivery", "OnSettled", "Settled", "Transport"]


@dataclass(slots=True)
class Settled:
    """What the stages have made of the work announced so far in one delivery.

    ``vectors`` and ``missing_vectors`` are the guard's sample: units that got a vector and units
    whose embedding failed for good. The in-memory transport counts chunks; the Kafka transport counts
    documents (committed, or failed at the embed step), since no stage records a failed batch's size."""

    indexed: int = 0
    failed: int = 0
    chunks: int = 0
    deleted: int = 0
    vectors: int = 0
    missing_vectors: int = 0


OnSettled = Callable[[Settled], None]
"""Called with the latest ``Settled`` whenever it moves; what it raises (the guard's
``EmbeddingDegraded``) stops the delivery and leaves its ``open`` block."""


class Delivery(Protocol):
    """One job's channel to the stages, open for the ``Transport.open`` block."""

    async def changed(self, message: DocumentChanged) -> None:
        """Announce a changed document (a durable hand-off: it is processed even if this process stops
        for the Kafka transport, or within this block for the in-memory one)."""

    async def deleted(self, message: DocumentDeleted) -> None:
        """Announce a deletion."""

    async def settle(self) -> Settled:
        """Wait until every announcement of this delivery is indexed, deleted or failed for good."""


class Transport(Protocol):
    """Opens a ``Delivery`` per job; ``on_settled`` sees the stages' progress while the block runs."""

    def open(self, on_settled: OnSettled) -> AbstractAsyncContextManager[Delivery]: ...
