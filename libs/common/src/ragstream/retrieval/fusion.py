"""Fusing the two legs: Reciprocal Rank Fusion, or a convex combination of their scores.

RRF only sees ranks, so a chunk the keyword leg ranks first by a wide margin counts no more than one
it ranks first by a hair. The convex combination keeps the margins: Bruch, Gai and Ingber ("An
Analysis of Fusion Functions for Hybrid Retrieval", ACM TOIS 2023) find it ahead of RRF in and out of
domain, tunable with a few queries. ``docs/retrieval-quality.md`` measures both on InsuranceQA.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from ragstream.storage.search import Hit

__all__ = ["RRF_K", "Fusion", "convex_fusion", "reciprocal_rank_fusion"]

RRF_K = 60

Fusion = Literal["rrf", "convex"]


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


def convex_fusion(
    vector: Sequence[Hit], keyword: Sequence[Hit], *, alpha: float, similarity: Mapping[str, float]
) -> list[tuple[str, float]]:
    """``score(d) = alpha · keyword(d) / max keyword + (1 − alpha) · cosine(d)``, best first.

    Each score is normalised by its theoretical minimum (0 for BM25, cosine taken as is) and the
    keyword leg's best score, not min-max over the candidates: min-max stretches a leg whose
    candidates are all about equally (ir)relevant into a full 0..1 spread. ``similarity`` holds the
    cosine of keyword-only chunks (the vector leg's scores are in its hits); a chunk without one (no
    vector yet) gets the vector leg's lowest, as no better than anything it returned. A chunk only
    the vector leg returned scored below the keyword leg's cut (or matched no term): its keyword
    score counts as 0.
    """
    if not 0 <= alpha <= 1:
        raise ValueError("alpha is the keyword leg's share, between 0 and 1")
    cosine = {hit.chunk_id: hit.score for hit in vector}
    floor = min(cosine.values(), default=0.0)
    best = max((hit.score for hit in keyword), default=0.0)
    lexical = {hit.chunk_id: hit.score / best for hit in keyword} if best > 0 else {}
    scores = {
        chunk: alpha * lexical.get(chunk, 0.0) + (1 - alpha) * cosine.get(chunk, similarity.get(chunk, floor))
        for chunk in dict.fromkeys([hit.chunk_id for hit in vector] + [hit.chunk_id for hit in keyword])
    }
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))
