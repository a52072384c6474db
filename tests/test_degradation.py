"""The embedding guard's decision, as a table: when a sync is stopped for missing vectors."""

from __future__ import annotations

import pytest

from ragstream.degradation import EmbeddingDegraded, EmbeddingGuard


@pytest.mark.parametrize(
    ("embedded", "failed", "final", "stops"),
    [
        (0, 0, True, False),  # nothing chunked: nothing to judge
        (4, 16, False, False),  # exactly 80% is not over the limit
        (3, 17, False, True),  # 85% on the minimum sample
        (0, 19, False, False),  # all failing, but below the sample: keep going for now
        (0, 19, True, True),  # ...and fail at the end of a small sync
        (1, 4, True, False),  # 80% at the end
        (90, 10, True, False),
    ],
)
def test_the_guard_stops_over_80_percent_after_the_sample(embedded: int, failed: int, final: bool, stops: bool) -> None:
    guard = EmbeddingGuard(max_failed_ratio=0.8, min_chunks=20)
    guard.record(embedded=embedded, failed=failed)
    if not stops:
        guard.check(final=final)
        return
    with pytest.raises(EmbeddingDegraded, match=rf"^embedding degraded: {failed * 100 // (embedded + failed)}% "):
        guard.check(final=final)
