"""Reciprocal Rank Fusion: a result high in both legs beats one high in only one."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RRF_K", "reciprocal_rank_fusion"]

RRF_K = 60


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[str]], *, weights: Sequence[float] | None = None, k: int = RRF_K
) -> list[tuple[str, float]]:
    """``score(d) = Σ weight_r / (k + rank_r(d))``, best first; ties break by id for stable output.

    A ranking that lists the same id twice counts it once, at its best rank.
    """
    weights = weights if weights is not None else [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise ValueError("one weight per ranking")
    scores: dict[str, float] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        seen: set[str] = set()
        for rank, item in enumerate(ranking, start=1):
            if item not in seen:
                seen.add(item)
                scores[item] = scores.get(item, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))
