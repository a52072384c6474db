"""Embedding degradation guard: a sync whose chunks mostly come back without a vector fails loudly.

A degraded embedding service (throttling, an expired key, a proxy answering empty lists) makes every
document fail at the embed step. Each failure alone is per document and harmless, but a sync that
"completes" that way leaves an index that looks built and retrieves nothing. Documents whose
embedding failed are never committed (the index step only runs on embedded batches), so stopping
early keeps the previously committed index as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragstream.core.errors import RagstreamError

__all__ = ["EmbeddingDegraded", "EmbeddingGuard"]


class EmbeddingDegraded(RagstreamError):
    """Too many chunks of one sync came back without a vector; the sync stops."""

    code = "embedding_degraded"


@dataclass(slots=True)
class EmbeddingGuard:
    """Counts the chunks of one sync that got a vector and those that did not.

    ``min_chunks`` keeps the first unlucky batch from stopping a large sync; the final check at the
    end of a sync applies the ratio to any sample, so a small all-failing sync fails too.
    """

    max_failed_ratio: float = 0.8
    min_chunks: int = 20
    embedded: int = 0
    failed: int = 0

    def record(self, *, embedded: int = 0, failed: int = 0) -> None:
        self.embedded += embedded
        self.failed += failed

    @property
    def failed_ratio(self) -> float:
        total = self.embedded + self.failed
        return self.failed / total if total else 0.0

    def check(self, *, final: bool = False) -> None:
        """Raise ``EmbeddingDegraded`` once the ratio is over the limit on a large enough sample."""
        total = self.embedded + self.failed
        if total and (final or total >= self.min_chunks) and self.failed_ratio > self.max_failed_ratio:
            raise EmbeddingDegraded(
                f"embedding degraded: {self.failed_ratio:.0%} of chunks ({self.failed} of {total}) came back "
                f"without a vector, over the {self.max_failed_ratio:.0%} limit; the sync stopped and the "
                "previously indexed documents are unchanged"
            )
