"""The progress of a run: per-kind counts, and the total, done, rate and ETA derived from them here only.

Every kind's progress is a ``RunProgress``: it says what its total, done and processed (the work this
run did itself, which a resumed run's earlier work is not) are; the rate, the ETA and the document a
run row stores (``runs.progress``) are computed by the base class, the same way for every kind and
in both transports."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ragstream.storage.cursors import Direction

__all__ = ["ReplayProgress", "RunProgress", "SyncProgress"]


@dataclass(slots=True, kw_only=True)
class RunProgress(ABC):
    """A snapshot for progress bars, run rows and the API: what is known, what is done, how fast."""

    started_at: float = field(default_factory=time.monotonic)

    @property
    @abstractmethod
    def total(self) -> int:
        """How many items the run has to go through (so far, while ``total_known`` is False)."""

    @property
    @abstractmethod
    def done(self) -> int:
        """How many of them are done, by this run or an earlier one it resumed."""

    @property
    @abstractmethod
    def processed(self) -> int:
        """How many this run has processed itself: the rate's numerator."""

    @property
    def total_known(self) -> bool:
        """False while the total may still grow (a sync's listing)."""
        return True

    @abstractmethod
    def counts(self) -> dict[str, Any]:
        """The kind's own counts, as the progress document stores them."""

    @property
    def rate(self) -> float:
        """Items processed per second over the run so far."""
        elapsed = time.monotonic() - self.started_at
        return self.processed / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate; unknown until something has been processed, and once done."""
        if self.total_known and self.done >= self.total:
            return None
        rate = self.rate
        return max(self.total - self.done, 0) / rate if rate > 0 else None

    def document(self) -> dict[str, Any]:
        """The progress document of the run row: the counts, then total, done, rate and ETA."""
        return {
            **self.counts(),
            "total": self.total,
            "done": self.done,
            "rate": round(self.rate, 3),
            "eta_seconds": self.eta_seconds,
        }


@dataclass(slots=True, kw_only=True)
class SyncProgress(RunProgress):
    """A sync's counts (and a replay's while it settles, before ``ReplayProgress`` shows them): documents
    listed, unchanged, changed, indexed, deleted, failed."""

    listed: int = 0
    unchanged: int = 0
    changed: int = 0
    indexed: int = 0
    deleted: int = 0
    failed_fetching: int = 0
    failed_processing: int = 0
    chunks: int = 0
    # Entries the connector left out, by reason (a symlink, a special file): never indexed.
    skipped: dict[str, int] = field(default_factory=dict)
    listing_done: bool = False
    # Which walk this sync is (backward: the first, full one), and whether it resumed a stopped one.
    direction: Direction | None = None
    resumed: bool = False

    @property
    def failed(self) -> int:
        return self.failed_fetching + self.failed_processing

    @property
    def total(self) -> int:
        return self.listed

    @property
    def done(self) -> int:
        return self.unchanged + self.indexed + self.failed

    @property
    def processed(self) -> int:
        return self.indexed + self.failed

    @property
    def total_known(self) -> bool:
        return self.listing_done

    def counts(self) -> dict[str, Any]:
        return {
            "listed": self.listed,
            "unchanged": self.unchanged,
            "changed": self.changed,
            "indexed": self.indexed,
            "deleted": self.deleted,
            "failed": self.failed,
            "chunks": self.chunks,
            "skipped": sum(self.skipped.values()),
            "listing_done": self.listing_done,
            "direction": self.direction,
            "resumed": self.resumed,
        }


@dataclass(slots=True, kw_only=True)
class ReplayProgress(RunProgress):
    """A replay's counts: failed documents re-driven, those a sync must fetch again, dead letters
    resolved since; in embedded mode also how many indexed and failed again (the Kafka mode only
    publishes, and its stage services take it from there)."""

    replayed: int = 0
    needs_sync: int = 0
    resolved: int = 0
    indexed: int | None = None
    failed_again: int | None = None

    @property
    def total(self) -> int:
        return self.replayed

    @property
    def done(self) -> int:
        if self.indexed is None or self.failed_again is None:
            return self.replayed
        return self.indexed + self.failed_again

    @property
    def processed(self) -> int:
        return self.done

    def counts(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed,
            "needs_sync": self.needs_sync,
            "resolved": self.resolved,
            "indexed": self.indexed,
            "failed_again": self.failed_again,
        }
