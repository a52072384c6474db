"""Fusing the legs: Reciprocal Rank Fusion, a convex combination of their scores, or distribution-based
score fusion.

RRF only sees ranks, so a chunk the keyword leg ranks first by a wide margin counts no more than one
it ranks first by a hair. The convex combination keeps the margins: Bruch, Gai and Ingber ("An
Analysis of Fusion Functions for Hybrid Retrieval", ACM TOIS 2023) find it ahead of RRF in and out of
domain, tunable with a few queries. Distribution-based score fusion (DBSF, as Qdrant names it) keeps
the margins too, each leg's scores measured against the spread of that leg's own results for the
query, so that BM25 and cosines of several models add up on one scale. ``docs/retrieval-quality.md``
measures them on InsuranceQA.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ragstream.core.vectors import BILINGUAL_MODEL_KEY, BILINGUAL_PAIR_MODEL_KEY
from ragstream.embedding.bilingual import is_chinese
from ragstream.storage.search import Hit

__all__ = [
    "DEFAULT_FUSION",
    "MEASURED_FUSION",
    "RRF_K",
    "VECTOR",
    "AnyFusion",
    "ConvexFusion",
    "DistributionFusion",
    "Fusion",
    "FusionConfig",
    "FusionOrigin",
    "OneFusion",
    "QueryLanguageFusion",
    "RrfFusion",
    "VectorScores",
    "convex_fusion",
    "distribution_fusion",
    "effective_fusion",
    "parse_fusion",
    "reciprocal_rank_fusion",
]

logger = logging.getLogger(__name__)

RRF_K = 60

Fusion = Literal["rrf", "convex", "dbsf"]


VECTOR = "vector"
"""The name of the vector ranking of whole vectors; a space of blocks ranks each block under its name."""

BlockWeights = Annotated[
    dict[Annotated[str, Field(max_length=40)], Annotated[float, Field(ge=0, le=100)]],
    Field(
        title="Weight of each block's leg",
        description="For a space whose vectors are blocks searched apart (bge, use); a block not named "
        "here weighs vector_weight.",
        max_length=8,
    ),
]


class _Weights(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vector_weight: Annotated[float, Field(title="Weight of the vector leg", ge=0, le=100)] = 1.0
    block_weights: BlockWeights = {}

    def weight_of(self, ranking: str) -> float:
        """The weight of the vector ranking named ``ranking`` (``VECTOR``, or a block's name)."""
        return self.block_weights.get(ranking, self.vector_weight)

    def for_query(self, query: str) -> Self:
        """The fusion of a search for ``query``: this one, whatever its language."""
        return self

    def uses(self, ranking: str) -> bool:
        """Whether the vector ranking named ``ranking`` can move the fused order: a leg it does not
        use need not run."""
        return self.weight_of(ranking) > 0

    def blocks_named(self) -> set[str]:
        """The block names these weights name, which the space's vectors must have."""
        return set(self.block_weights)


class _CrossLanguageWeights(_Weights):
    """Weights with the keyword leg's own, and per block a weight of its hits in the other language."""

    keyword_weight: Annotated[float, Field(title="Weight of the keyword leg", ge=0, le=100)] = 1.0
    cross_language_weights: Annotated[
        dict[Annotated[str, Field(max_length=40)], Annotated[float, Field(ge=0, le=100)]],
        Field(
            title="Weight of a block leg's hits in the other language",
            description="For the bilingual space: the USE block finds pages across languages, where the "
            "BGE block cannot, so its hits in a language other than the query's (Chinese or not) may "
            "weigh more than those in the query's own, where BGE is the stronger.",
            max_length=8,
        ),
    ] = {}
    tuned_on: Annotated[str | None, Field(title="Where these weights were measured", max_length=500)] = None

    def blocks_named(self) -> set[str]:
        return set(self.block_weights) | set(self.cross_language_weights)

    def uses(self, ranking: str) -> bool:
        return super().uses(ranking) or self.cross_language_weights.get(ranking, 0.0) > 0


class RrfFusion(_CrossLanguageWeights):
    """Reciprocal Rank Fusion of the legs' rankings, each with its weight; a block named in
    ``cross_language_weights`` weighs its hits in another language than the query's by that weight."""

    kind: Literal["rrf"] = "rrf"
    k: Annotated[int, Field(title="RRF k", ge=1, le=1000)] = RRF_K


class DistributionFusion(_CrossLanguageWeights):
    """Distribution-based score fusion (``distribution_fusion``): each leg's scores placed on 0..1 by the
    spread of that leg's own results, then summed with the legs' weights; a block named in
    ``cross_language_weights`` weighs its hits in another language than the query's by that weight."""

    kind: Literal["dbsf"] = "dbsf"

    @classmethod
    def keyword_share(cls, share: float, **fields: object) -> DistributionFusion:
        """The keyword leg weighing ``share`` and the vector leg the rest."""
        return cls.model_validate({"keyword_weight": share, "vector_weight": round(1 - share, 6), **fields})


class ConvexFusion(_Weights):
    """A convex combination of the legs' normalised scores, ``alpha`` being the keyword leg's share; with
    several vector rankings (blocks) the rest is shared between them in proportion to their weights."""

    kind: Literal["convex"] = "convex"
    alpha: Annotated[float, Field(title="Keyword leg's share", ge=0, le=1)] = 0.6
    tuned_on: Annotated[str | None, Field(title="Where this share was measured", max_length=500)] = None


OneFusion = RrfFusion | ConvexFusion | DistributionFusion
"""A fusion of one query's legs."""

_OneFusion = Annotated[OneFusion, Field(discriminator="kind")]


class QueryLanguageFusion(BaseModel):
    """One fusion for a Chinese query and another for any other (``is_chinese``, the bilingual embedder's
    rule), for a space whose legs differ in strength by language: in the bilingual space BGE small zh is
    about as strong as BM25 on Chinese, BGE small en far stronger than BM25 on English."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["query_language"] = "query_language"
    chinese: Annotated[_OneFusion, Field(title="Fusion of a Chinese query")]
    other: Annotated[_OneFusion, Field(title="Fusion of any other query")]
    tuned_on: Annotated[str | None, Field(title="Where these weights were measured", max_length=500)] = None

    def for_query(self, query: str) -> OneFusion:
        return self.chinese if is_chinese(query) else self.other

    def blocks_named(self) -> set[str]:
        return self.chinese.blocks_named() | self.other.blocks_named()


AnyFusion = OneFusion | QueryLanguageFusion

FusionConfig = Annotated[AnyFusion, Field(discriminator="kind")]
"""How an embedding space's vector leg is fused with the keyword leg: stored with the space."""

_FUSION = TypeAdapter[AnyFusion](FusionConfig)


def parse_fusion(stored: object) -> AnyFusion:
    """A fusion as stored in ``embedding_spaces.fusion`` (or sent by a caller)."""
    return _FUSION.validate_python(stored)


FusionOrigin = Literal["space", "operator", "measured", "default"]
"""Where a space's effective fusion comes from: its own stored one, the operator's deployment-wide
``RAGSTREAM_FUSION*``, the one measured for its model, or the default."""


def effective_fusion(model_key: str | None, stored: object, chosen: OneFusion | None) -> tuple[AnyFusion, FusionOrigin]:
    """The fusion a space's searches use, and why. A stored fusion this build cannot read is logged
    and passed over: a search never fails for it."""
    if stored is not None:
        try:
            return parse_fusion(stored), "space"
        except ValidationError as error:
            logger.warning("space %s has an unreadable fusion, passed over: %s", model_key, error)
    if chosen is not None:
        return chosen, "operator"
    measured = MEASURED_FUSION.get(model_key) if model_key is not None else None
    return (measured, "measured") if measured is not None else (DEFAULT_FUSION, "default")


#: A space whose model was never measured, with no fusion of its own nor the operator's: the convex share
#: tuned for the default embedder (the ``RAGSTREAM_FUSION*`` defaults).
DEFAULT_FUSION = ConvexFusion(alpha=0.6)

#: The fusion measured for each bundled model on InsuranceQA ``valid`` queries 1-500 (tuned) and checked on
#: 501-1,000 (held out), docs/retrieval-quality.md: weights follow the embedder's strength, so a
#: space of one of these models fuses with its own measured weights unless an operator set others.
MEASURED_FUSION: dict[str, AnyFusion] = {
    "use-multilingual-v3-512": ConvexFusion(
        alpha=0.6, tuned_on="InsuranceQA valid 1-500, en and zh together; held out 501-1,000: en +0.011 over BM25"
    ),
    "bge-small-en-v1.5-384": DistributionFusion(
        keyword_weight=0.35,
        vector_weight=0.65,
        tuned_on="InsuranceQA valid 1-500, en, exact vector legs; held out 501-1,000: 0.4238 nDCG@10, +0.017 over "
        "the vector leg (RRF k 5, 1 / 0.5: 0.4184)",
    ),
    BILINGUAL_PAIR_MODEL_KEY: QueryLanguageFusion(
        chinese=DistributionFusion(
            keyword_weight=0.45,
            block_weights={"bge": 0.15, "bge_v1": 0.4, "use": 0.0},
            cross_language_weights={"use": 0.9},
        ),
        other=DistributionFusion(
            keyword_weight=0.35,
            block_weights={"bge": 0.65, "bge_v1": 0.0, "use": 0.0},
            cross_language_weights={"use": 1.0},
        ),
        tuned_on="InsuranceQA valid 1-500 per language (keyword + BGE small v1.5 of the language + BGE small zh v1; "
        "distribution-based fusion; USE weighs only its hits in the other language than the query's); held out "
        "501-1,000: zh 0.3038 nDCG@10, +0.054 over the best leg (BGE small zh v1); en 0.4238, +0.017 over the BGE "
        "leg; all 26 cross-lingual questions of the bundled knowledge base find their page",
    ),
    BILINGUAL_MODEL_KEY: QueryLanguageFusion(
        chinese=DistributionFusion(
            keyword_weight=0.45, block_weights={"bge": 0.45, "use": 0.1}, cross_language_weights={"use": 0.9}
        ),
        other=DistributionFusion(
            keyword_weight=0.35, block_weights={"bge": 0.65, "use": 0.0}, cross_language_weights={"use": 1.0}
        ),
        tuned_on="InsuranceQA valid 1-500 per language (keyword + BGE small of the language + USE; distribution-"
        "based fusion, the best family on both languages together); held out 501-1,000: zh 0.2863 nDCG@10, +0.058 "
        "over the keyword leg and over the BGE leg; en 0.4238, +0.133 over the keyword leg, +0.017 over the BGE leg; "
        "USE hits in the other language than the query's at 0.9 (zh) and 1.0 (en): all 26 cross-lingual questions "
        "of the bundled knowledge base find their page",
    ),
    "bge-small-zh-v1.5-512": ConvexFusion(
        alpha=0.3, tuned_on="InsuranceQA valid 1-500, zh; held out 501-1,000: 0.2704 nDCG@10, +0.042 over BM25"
    ),
}


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[str]],
    *,
    weights: Sequence[float] | None = None,
    k: int = RRF_K,
    item_weights: Sequence[Mapping[str, float]] | None = None,
) -> list[tuple[str, float]]:
    """``score(d) = Σ weight_r(d) / (k + rank_r(d))``, best first; ties break by id for stable output.

    ``weight_r(d)`` is ranking r's weight, or the one ``item_weights[r]`` gives ``d``. A ranking that
    lists the same id twice counts it once, at its best rank.
    """
    weights = weights if weights is not None else [1.0] * len(rankings)
    overrides = item_weights if item_weights is not None else [{}] * len(rankings)
    if len(weights) != len(rankings) or len(overrides) != len(rankings):
        raise ValueError("one weight per ranking")
    scores: dict[str, float] = {}
    for ranking, weight, override in zip(rankings, weights, overrides, strict=True):
        seen: set[str] = set()
        for rank, item in enumerate(ranking, start=1):
            if item not in seen:
                seen.add(item)
                scores[item] = scores.get(item, 0.0) + override.get(item, weight) / (k + rank)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


@dataclass(frozen=True, slots=True)
class VectorScores:
    """One vector ranking for ``convex_fusion``: its weight, its hits (with their cosines), and the cosine
    of keyword-only chunks it did not return."""

    weight: float
    hits: Sequence[Hit]
    similarity: Mapping[str, float]


def convex_fusion(vectors: Sequence[VectorScores], keyword: Sequence[Hit], *, alpha: float) -> list[tuple[str, float]]:
    """``score(d) = alpha · keyword(d) / max keyword + (1 − alpha) · Σ wᵢ · cosineᵢ(d) / Σ wᵢ``, best first.

    Each score is normalised by its theoretical minimum (0 for BM25, cosine taken as is) and the
    keyword leg's best score, not min-max over the candidates: min-max stretches a leg whose
    candidates are all about equally (ir)relevant into a full 0..1 spread. A ranking's ``similarity``
    holds the cosine of keyword-only chunks (its hits carry their own); a chunk without one (no vector
    yet) gets that ranking's lowest, as no better than anything it returned. A chunk only a vector
    ranking returned scored below the keyword leg's cut (or matched no term): its keyword score counts
    as 0.
    """
    if not 0 <= alpha <= 1:
        raise ValueError("alpha is the keyword leg's share, between 0 and 1")
    total = sum(ranking.weight for ranking in vectors)
    best = max((hit.score for hit in keyword), default=0.0)
    lexical = {hit.chunk_id: hit.score / best for hit in keyword} if best > 0 else {}
    candidates = dict.fromkeys(
        [hit.chunk_id for ranking in vectors for hit in ranking.hits] + [hit.chunk_id for hit in keyword]
    )
    scores = dict.fromkeys(candidates, 0.0)
    for ranking in vectors if total > 0 else []:
        cosine = {hit.chunk_id: hit.score for hit in ranking.hits}
        floor = min(cosine.values(), default=0.0)
        share = (1 - alpha) * ranking.weight / total
        for chunk in candidates:
            scores[chunk] += share * cosine.get(chunk, ranking.similarity.get(chunk, floor))
    for chunk in candidates:
        scores[chunk] += alpha * lexical.get(chunk, 0.0)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


def distribution_fusion(
    vectors: Sequence[VectorScores],
    keyword: Sequence[Hit],
    *,
    keyword_weight: float,
    item_weights: Sequence[Mapping[str, float]] | None = None,
) -> list[tuple[str, float]]:
    """``score(d) = keyword_weight · n(keyword(d)) + Σ wᵢ(d) · n(cosineᵢ(d))``, best first; ties by id.

    ``n`` places a leg's score on 0..1 by the spread of that leg's own results for the query: 0 at
    their mean minus three standard deviations, 1 at their mean plus three, clipped (results all
    equal: 1 for a score as good, else 0). BM25 has no fixed scale and each model places its cosines
    its own way, so each leg is measured against its own results: a result far above the leg's others
    scores near 1, one among many alike near the middle. ``wᵢ(d)`` is ranking i's weight, or the one
    ``item_weights[i]`` gives ``d``. A ranking's ``similarity`` holds the cosine of keyword-only
    chunks it did not return, measured on its scale; a chunk a leg did not return and has no score
    from adds nothing for that leg.
    """
    overrides = item_weights if item_weights is not None else [{}] * len(vectors)
    if len(overrides) != len(vectors):
        raise ValueError("one item weight mapping per vector ranking")
    candidates = dict.fromkeys(
        [hit.chunk_id for ranking in vectors for hit in ranking.hits] + [hit.chunk_id for hit in keyword]
    )
    scores = dict.fromkeys(candidates, 0.0)
    normalise = _spread([hit.score for hit in keyword])
    for hit in keyword:
        scores[hit.chunk_id] += keyword_weight * normalise(hit.score)
    for ranking, override in zip(vectors, overrides, strict=True):
        normalise = _spread([hit.score for hit in ranking.hits])
        cosine = {**ranking.similarity, **{hit.chunk_id: hit.score for hit in ranking.hits}}
        for chunk in candidates:
            if chunk in cosine:
                scores[chunk] += override.get(chunk, ranking.weight) * normalise(cosine[chunk])
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


def _spread(values: Sequence[float]) -> Callable[[float], float]:
    """A score of a leg on 0..1, from the mean ± 3 standard deviations of the leg's ``values``."""
    if not values:
        return lambda value: 0.0
    deviation = statistics.pstdev(values)
    if deviation == 0:
        return lambda value: 1.0 if value >= values[0] else 0.0
    low = statistics.fmean(values) - 3 * deviation
    return lambda value: min(1.0, max(0.0, (value - low) / (6 * deviation)))
