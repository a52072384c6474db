"""The one progress type of a sync or a replay: counts, and the rate and ETA derived from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ragstream.control.runs import RunCounts
from ragstream.storage.cursors import Direction

__all__ = ["SyncProgress"]


@dataclass(slots=True)
class SyncProgress:
    """A snapshot for progress bars, run rows and the API: what is known, what is done, how fast.

    ``rate`` and ``eta_seconds`` are computed here and nowhere else, the same way in both transports."""

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
    started_at: float = field(default_factory=time.monotonic)

    @property
    def failed(self) -> int:
        return self.failed_fetching + self.failed_processing

    @property
    def done(self) -> int:
        return self.unchanged + self.indexed + self.failed

    @property
    def rate(self) -> float:
        """Documents indexed or failed per second over the sync so far."""
        elapsed = time.monotonic() - self.started_at
        return (self.indexed + self.failed) / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate; unknown until something has been processed, and once done."""
        rate = self.rate
        if self.listing_done and self.done >= self.listed:
            return None
        return max(self.listed - self.done, 0) / rate if rate > 0 else None

    def run_counts(self) -> RunCounts:
        """The counts as a run row stores them."""
        return RunCounts(
            listed=self.listed,
            unchanged=self.unchanged,
            changed=self.changed,
            indexed=self.indexed,
            deleted=self.deleted,
            failed=self.failed,
            chunks=self.chunks,
            listing_done=self.listing_done,
            direction=self.direction,
            resumed=self.resumed,
            skipped=sum(self.skipped.values()),
        )
