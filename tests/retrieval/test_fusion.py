"""The fusions: RRF by ranks, the convex combination and distribution-based score fusion by scores; and
the retriever's score fusions on a real PostgreSQL, checked against cosines computed here from the
stored vectors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.retrieval import HybridRetriever, RetrievalSettings, SearchFilters, SearchRequest
from ragstream.retrieval.fusion import (
    VECTOR,
    ConvexFusion,
    DistributionFusion,
    RrfFusion,
    VectorScores,
    convex_fusion,
    distribution_fusion,
    reciprocal_rank_fusion,
)
from ragstream.runtime import Runtime
from ragstream.segmentation import query_terms
from ragstream.storage.citations import CitationStore
from ragstream.storage.scope import Scope
from ragstream.storage.search import Hit, SearchStore


def order(fused: list[tuple[str, float]]) -> list[str]:
    return [chunk for chunk, _ in fused]


def test_rrf_puts_a_chunk_both_legs_found_above_either_legs_first() -> None:
    fused = reciprocal_rank_fusion([["v1", "both", "v3"], ["k1", "both", "v3"]])
    assert order(fused)[:2] == ["both", "v3"]
    assert dict(reciprocal_rank_fusion([["a", "b", "a"]]))["a"] == pytest.approx(1 / 61)  # a repeat counts once
    assert order(reciprocal_rank_fusion([["v"], ["k"]], weights=[1.0, 3.0])) == ["k", "v"]
    with pytest.raises(ValueError, match="one weight per ranking"):
        reciprocal_rank_fusion([["a"]], weights=[1.0, 2.0])


def test_convex_keeps_the_margin_rrf_throws_away() -> None:
    # The keyword leg is sure of "exact" (ten times the BM25 of the next); "near" is in both legs.
    keyword = [Hit("exact", 10.0), Hit("near", 1.0)]
    vector = [Hit("near", 0.50), Hit("other", 0.45)]
    similarity = {"exact": 0.20}

    fused = convex_fusion([VectorScores(1.0, vector, similarity)], keyword, alpha=0.7)

    assert order(reciprocal_rank_fusion([["near", "other"], ["exact", "near"]]))[0] == "near"
    assert order(fused) == ["exact", "near", "other"]
    assert dict(fused) == pytest.approx({"exact": 0.7 + 0.3 * 0.2, "near": 0.07 + 0.3 * 0.5, "other": 0.3 * 0.45})


def test_convex_at_its_ends_is_one_leg() -> None:
    keyword = [Hit("k1", 3.0), Hit("k2", 2.0), Hit("both", 1.0)]
    vector = [Hit("v1", 0.9), Hit("both", 0.8), Hit("v2", 0.7)]
    similarity = {"k1": 0.1, "k2": 0.75}

    assert order(convex_fusion([VectorScores(1.0, vector, similarity)], keyword, alpha=1.0))[:3] == ["k1", "k2", "both"]
    assert order(convex_fusion([VectorScores(1.0, vector, similarity)], keyword, alpha=0.0)) == [
        "v1",
        "both",
        "k2",
        "v2",
        "k1",
    ]


def test_a_keyword_chunk_without_a_vector_counts_as_the_vector_legs_last() -> None:
    keyword = [Hit("unembedded", 1.0)]
    vector = [Hit("v1", 0.9), Hit("v2", 0.4)]

    fused = dict(convex_fusion([VectorScores(1.0, vector, {})], keyword, alpha=0.5))

    assert fused["unembedded"] == pytest.approx(0.5 + 0.5 * 0.4)


def test_convex_edge_cases() -> None:
    assert convex_fusion([VectorScores(1.0, [], {})], [], alpha=0.5) == []
    # A zero best keyword score (ts_rank can give 0) must not divide by zero.
    assert order(convex_fusion([VectorScores(1.0, [Hit("v", 0.3)], {"k": 0.1})], [Hit("k", 0.0)], alpha=0.5)) == [
        "v",
        "k",
    ]
    for alpha in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            convex_fusion([VectorScores(1.0, [], {})], [], alpha=alpha)


def spread(values: list[float], value: float) -> float:
    """``value`` on 0..1 between the mean of ``values`` minus and plus three standard deviations."""
    low, high = np.mean(values) - 3 * np.std(values), np.mean(values) + 3 * np.std(values)
    return float(np.clip((value - low) / (high - low), 0.0, 1.0))


def test_distribution_fusion_puts_each_leg_on_the_spread_of_its_own_results() -> None:
    keyword = [Hit("exact", 12.0), Hit("near", 3.0), Hit("far", 2.5)]
    vector = [Hit("near", 0.62), Hit("other", 0.60), Hit("far", 0.31)]
    similarity = {"exact": 0.40}

    fused = distribution_fusion([VectorScores(0.6, vector, similarity)], keyword, keyword_weight=0.4)

    bm25, cosines = [12.0, 3.0, 2.5], [0.62, 0.60, 0.31]
    assert dict(fused) == pytest.approx(
        {
            "exact": 0.4 * spread(bm25, 12.0) + 0.6 * spread(cosines, 0.40),
            "near": 0.4 * spread(bm25, 3.0) + 0.6 * spread(cosines, 0.62),
            "far": 0.4 * spread(bm25, 2.5) + 0.6 * spread(cosines, 0.31),
            "other": 0.6 * spread(cosines, 0.60),  # no keyword score: nothing from that leg
        }
    )
    assert [score for _, score in fused] == sorted((score for _, score in fused), reverse=True)
    # BM25 at ten times the scale ranks the same: each leg is measured against its own results.
    scaled = [Hit(hit.chunk_id, 10 * hit.score) for hit in keyword]
    assert order(distribution_fusion([VectorScores(0.6, vector, similarity)], scaled, keyword_weight=0.4)) == order(
        fused
    )


def test_distribution_fusion_weighs_chosen_items_and_survives_flat_legs() -> None:
    use = VectorScores(0.1, [Hit("same", 0.5), Hit("other", 0.4)], {})
    plain = dict(distribution_fusion([use], [Hit("k", 1.0)], keyword_weight=0.5))
    weighted = dict(distribution_fusion([use], [Hit("k", 1.0)], keyword_weight=0.5, item_weights=[{"other": 0.9}]))
    assert weighted["other"] == pytest.approx(9 * plain["other"]) and weighted["same"] == plain["same"]
    # One keyword hit (no spread) counts in full; a read-back cosine below a flat leg's counts nothing.
    assert plain["k"] == pytest.approx(0.5)
    flat = VectorScores(1.0, [Hit("a", 0.3), Hit("b", 0.3)], {"k": 0.1})
    assert dict(distribution_fusion([flat], [Hit("k", 2.0)], keyword_weight=0.5)) == {"a": 1.0, "b": 1.0, "k": 0.5}
    assert distribution_fusion([VectorScores(1.0, [], {})], [], keyword_weight=1.0) == []
    with pytest.raises(ValueError, match="one item weight mapping per vector ranking"):
        distribution_fusion([use], [], keyword_weight=1.0, item_weights=[])


@pytest.mark.integration
@pytest.mark.parametrize(
    "fusion", [ConvexFusion(alpha=0.6), DistributionFusion(keyword_weight=0.4)], ids=["convex", "dbsf"]
)
async def test_the_retriever_scores_every_candidate_by_both_legs(
    runtime: Runtime, corpus: Path, fusion: ConvexFusion | DistributionFusion
) -> None:
    """With legs of 2, one of the keyword leg's chunks (crafts.md: "trades" five times, about jobs)
    falls outside the vector leg: its cosine is read from the store, so each fused score is, for every
    result, alpha · BM25 / best + (1 − alpha) · cosine (convex), or each leg's score on the spread of
    its own results, weighted (distribution-based)."""
    documents = {
        "kafka.md": "# Kafka retention\n\nThe trades topic keeps messages for thirty days.",
        "backup.md": "# Backups\n\nThe database is backed up every night; restores are tested monthly.",
        "leave.md": "# Leave\n\nEmployees have twenty-five days of paid leave a year.",
        "vpn.md": "# VPN\n\nConnect to the office network with the VPN client before opening the wiki.",
        "retention.md": "# Data retention\n\nCustomer records are kept for seven years, then deleted.",
        "on-call.md": "# On call\n\nThe on-call engineer answers pages within fifteen minutes.",
        "crafts.md": "# Trades\n\nTrades: plumbers, electricians and carpenters. Trades, trades and more trades.",
    }
    for name, text in documents.items():
        (corpus / name).write_text(text)
    connector = FolderConnector(corpus)
    assert (await runtime.pipeline().sync(connector)).ok
    filters = SearchFilters(connection_ids=[connector.connection_id])
    query = "how many days of retention does the trades topic keep"
    store = SearchStore(runtime.pool)
    retriever = HybridRetriever(
        store, runtime.embedder, CitationStore(runtime.pool), settings=RetrievalSettings(leg_size=2, fusion=fusion)
    )

    response = await retriever.search(SearchRequest(query=query, top_k=4, filters=filters))

    keyword = await store.keyword_leg(query_terms(query), 2, Scope.build(filters, None, first_param=3), query=query)
    table = await store.embedding_table(runtime.embedder.model_key)
    assert table is not None
    rows = await runtime.pool.fetch(
        f"SELECT e.chunk_id, e.embedding FROM {table} e JOIN chunks c ON c.id = e.chunk_id"
        " JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1",
        connector.connection_id,
    )
    query_vector = (await runtime.embedder.embed([query], kind="query"))[0]
    cosine = {
        row["chunk_id"]: float(
            np.dot(row["embedding"].to_numpy(), query_vector)
            / (np.linalg.norm(row["embedding"].to_numpy()) * np.linalg.norm(query_vector))
        )
        for row in rows
    }
    best = keyword[0].score
    lexical = {hit.chunk_id: hit.score / best for hit in keyword}
    nearest = sorted(cosine.values(), reverse=True)[:2]

    def expected(chunk: str) -> float:
        if isinstance(fusion, ConvexFusion):
            return fusion.alpha * lexical.get(chunk, 0.0) + (1 - fusion.alpha) * cosine[chunk]
        bm25 = [hit.score for hit in keyword]
        return fusion.keyword_weight * (spread(bm25, lexical[chunk] * best) if chunk in lexical else 0.0) + spread(
            nearest, cosine[chunk]
        )

    vector_only = [r for r in response.results if r.keyword_rank is None]
    keyword_only = [r for r in response.results if r.vector_rank is None]

    assert keyword_only and vector_only, "legs of 2 over 7 documents: each leg adds its own"
    assert len(response.results) == len({*lexical, *(r.chunk_id for r in vector_only)}) == 3
    for result in response.results:
        assert result.score == pytest.approx(expected(result.chunk_id), abs=1e-5), result.source
    assert [r.score for r in response.results] == sorted((r.score for r in response.results), reverse=True)
    assert response.results[0].source == "kafka.md"


def test_several_vector_rankings_share_the_vector_side_by_their_weights() -> None:
    """A space of blocks (BGE and USE) ranks each block apart; convex fusion gives each its share of
    1 − alpha, RRF its weight, and a block not named weighs ``vector_weight``."""
    keyword = [Hit("k", 2.0)]
    bge = VectorScores(1.0, [Hit("b", 0.8), Hit("k", 0.4)], {})
    use = VectorScores(3.0, [Hit("u", 0.6)], {"k": 0.2, "b": 0.1})

    fused = dict(convex_fusion([bge, use], keyword, alpha=0.2))

    assert fused == pytest.approx(
        {
            "k": 0.2 + 0.8 * (0.25 * 0.4 + 0.75 * 0.2),
            "b": 0.8 * (0.25 * 0.8 + 0.75 * 0.1),
            "u": 0.8 * (0.25 * 0.4 + 0.75 * 0.6),  # not in the BGE leg: its lowest cosine there
        }
    )
    fusion = RrfFusion(k=10, vector_weight=0.5, block_weights={"use": 2.0})
    assert (fusion.weight_of("use"), fusion.weight_of("bge"), fusion.weight_of(VECTOR)) == (2.0, 0.5, 0.5)


def test_an_item_of_a_ranking_can_weigh_more_than_its_ranking() -> None:
    """The bilingual space weighs the USE leg's hits in the other language than the query's higher."""
    rankings = [["same", "other"], ["kw"]]
    plain = dict(reciprocal_rank_fusion(rankings, weights=[0.25, 1.0], k=10))
    weighted = dict(reciprocal_rank_fusion(rankings, weights=[0.25, 1.0], k=10, item_weights=[{"other": 2.0}, {}]))
    assert plain["other"] == pytest.approx(0.25 / 12) and weighted["other"] == pytest.approx(2.0 / 12)
    assert weighted["same"] == plain["same"] == pytest.approx(0.25 / 11)
    assert (
        order(reciprocal_rank_fusion(rankings, weights=[0.25, 1.0], k=10, item_weights=[{"other": 2.0}, {}]))[0]
        == "other"
    )
    with pytest.raises(ValueError, match="one weight per ranking"):
        reciprocal_rank_fusion(rankings, item_weights=[{}])


def test_a_block_leg_runs_only_when_it_can_move_the_fused_order() -> None:
    """A block weighing 0 is not searched, unless its hits in the other language than the query's weigh."""
    fusion = DistributionFusion(keyword_weight=0.35, block_weights={"bge": 0.65, "bge_v1": 0.0, "use": 0.0})
    assert (fusion.uses("bge"), fusion.uses("bge_v1"), fusion.uses("use"), fusion.uses(VECTOR)) == (
        True,
        False,
        False,
        True,
    )
    across = fusion.model_copy(update={"cross_language_weights": {"use": 1.0}})
    assert across.uses("use") and not across.uses("bge_v1")
    assert not ConvexFusion(alpha=0.5, block_weights={"use": 0.0}).uses("use")
