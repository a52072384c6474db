"""Fusion weights belong to the embedding space: a space's own weights, else the operator's, else those
measured for its model, else the default; set and reset over the HTTP API, used by the next search."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.api.spaces import spaces_router
from ragstream.connectors.folder import FolderConnector
from ragstream.core.vectors import BILINGUAL_MODEL_KEY, BILINGUAL_PAIR_MODEL_KEY, vector_blocks
from ragstream.retrieval import HybridRetriever, SearchFilters, SearchRequest
from ragstream.retrieval.fusion import (
    DEFAULT_FUSION,
    MEASURED_FUSION,
    ConvexFusion,
    DistributionFusion,
    QueryLanguageFusion,
    RrfFusion,
    effective_fusion,
)
from ragstream.runtime import Runtime, chosen_fusion
from ragstream.settings import Settings
from ragstream.storage.citations import CitationStore
from ragstream.storage.search import SearchStore
from ragstream.storage.spaces import SpaceStore

USE = "use-multilingual-v3-512"
OWN = {"kind": "rrf", "k": 5, "vector_weight": 1.0, "keyword_weight": 0.5, "tuned_on": "our own questions"}


@pytest.mark.parametrize(
    ("model_key", "stored", "chosen", "expected"),
    [
        (USE, OWN, ConvexFusion(alpha=0.9), (RrfFusion.model_validate(OWN), "space")),
        (USE, None, ConvexFusion(alpha=0.9), (ConvexFusion(alpha=0.9), "operator")),
        (USE, None, None, (MEASURED_FUSION[USE], "measured")),
        ("bge-small-en-v1.5-384", None, None, (MEASURED_FUSION["bge-small-en-v1.5-384"], "measured")),
        ("somebody-elses-model-768", None, None, (DEFAULT_FUSION, "default")),
        (USE, {"kind": "rrf", "k": 0}, None, (MEASURED_FUSION[USE], "measured")),  # unreadable: passed over
        (USE, {"kind": "bm25f"}, None, (MEASURED_FUSION[USE], "measured")),
        (
            USE,
            {"kind": "query_language", "chinese": OWN, "other": {"kind": "convex"}},
            None,
            (QueryLanguageFusion(chinese=RrfFusion.model_validate(OWN), other=ConvexFusion()), "space"),
        ),
    ],
)
def test_a_space_fuses_with_its_own_then_the_operators_then_the_measured_weights(
    model_key: str, stored: object, chosen: RrfFusion | ConvexFusion | None, expected: object
) -> None:
    assert effective_fusion(model_key, stored, chosen) == expected


@pytest.mark.parametrize("model_key", [BILINGUAL_PAIR_MODEL_KEY, BILINGUAL_MODEL_KEY])
def test_the_bilingual_spaces_fuse_each_query_by_its_language(model_key: str) -> None:
    measured = MEASURED_FUSION[model_key]
    assert isinstance(measured, QueryLanguageFusion)
    assert measured.for_query("婚假可以休几天？") is measured.chinese
    assert measured.for_query("How many days of marriage leave?") is measured.other
    assert measured.chinese != measured.other
    assert measured.blocks_named() == {block.name for block in vector_blocks(model_key)}


def test_the_operators_fusion_counts_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chosen_fusion(Settings()) is None
    assert chosen_fusion(Settings(fusion="rrf")) == RrfFusion(k=60, vector_weight=1.0, keyword_weight=20.0)
    assert chosen_fusion(Settings(fusion="dbsf", fusion_alpha=0.35)) == DistributionFusion(
        keyword_weight=0.35, vector_weight=0.65
    )
    monkeypatch.setenv("RAGSTREAM_FUSION_ALPHA", "0.3")
    assert chosen_fusion(Settings()) == ConvexFusion(alpha=0.3)


@pytest.fixture
async def scope(runtime: Runtime, tmp_path: Path) -> AsyncIterator[SearchFilters]:
    """A small corpus whose legs disagree; the active space's own fusion is taken back afterwards."""
    texts = {
        "retention.md": "# Retention\n\nThe trades topic keeps its data for thirty days.\n",
        "storage.md": "# Storage\n\nOld records are moved to cold storage after a month.\n",
        "days.md": "# Days\n\nDays days days: a page that repeats the word days.\n",
        "keep.md": "# Keep\n\nWe keep the orderbook topic for nine days.\n",
    }
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    connector = FolderConnector(tmp_path)
    assert (await runtime.pipeline().sync(connector)).ok
    try:
        yield SearchFilters(connection_ids=[connector.connection_id])
    finally:
        await SpaceStore(runtime.pool).set_fusion(runtime.embedder.model_key, None)


@pytest.mark.integration
async def test_the_next_search_fuses_with_the_weights_stored_for_its_space(
    runtime: Runtime, scope: SearchFilters
) -> None:
    retriever = HybridRetriever(SearchStore(runtime.pool), runtime.embedder, CitationStore(runtime.pool))
    spaces = SpaceStore(runtime.pool)
    request = SearchRequest(query="how many days is data kept", top_k=4, filters=scope)

    def order(ranks: list[int | None]) -> list[int]:
        return [rank for rank in ranks if rank is not None]

    await spaces.set_fusion(runtime.embedder.model_key, {"kind": "rrf", "vector_weight": 1.0, "keyword_weight": 0.0})
    vector_only = await retriever.search(request)
    await spaces.set_fusion(runtime.embedder.model_key, {"kind": "rrf", "vector_weight": 0.0, "keyword_weight": 1.0})
    keyword_only = await retriever.search(request)

    ranked_by_vector = order([result.vector_rank for result in vector_only.results])
    ranked_by_keyword = order([result.keyword_rank for result in keyword_only.results])
    assert ranked_by_vector == sorted(ranked_by_vector) and len(ranked_by_vector) == 4
    assert ranked_by_keyword == sorted(ranked_by_keyword) and ranked_by_keyword
    assert [r.chunk_id for r in vector_only.results] != [r.chunk_id for r in keyword_only.results]

    # A fusion per query language: the English query fuses as keyword only, a Chinese one as vector only.
    await spaces.set_fusion(
        runtime.embedder.model_key,
        {
            "kind": "query_language",
            "chinese": {"kind": "rrf", "vector_weight": 1.0, "keyword_weight": 0.0},
            "other": {"kind": "rrf", "vector_weight": 0.0, "keyword_weight": 1.0},
        },
    )
    english = await retriever.search(request)
    assert [r.chunk_id for r in english.results] == [r.chunk_id for r in keyword_only.results]
    chinese = await retriever.search(request.model_copy(update={"query": "数据保留多少天 days"}))
    ranked_by_vector = order([result.vector_rank for result in chinese.results])
    assert ranked_by_vector == sorted(ranked_by_vector) and len(ranked_by_vector) == 4


@pytest.mark.integration
async def test_fusion_is_set_and_taken_back_over_http(runtime: Runtime, scope: SearchFilters) -> None:
    async def ready() -> bool:
        return True

    app = create_app(
        lambda: runtime.retriever, ready=ready, routers=[spaces_router(SpaceStore(runtime.pool), chosen=None)]
    )
    key = runtime.embedder.model_key
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        listed = (await client.get("/v1/spaces")).json()
        mine = next(space for space in listed if space["model_key"] == key)
        assert (mine["status"], mine["fusion_origin"], mine["fusion"]) == (
            "active",
            "measured",
            MEASURED_FUSION[key].model_dump(),
        )

        put = await client.put(f"/v1/spaces/{key}/fusion", json=OWN)
        shown = {**OWN, "block_weights": {}, "cross_language_weights": {}}  # the fields left out, at their defaults
        assert put.status_code == 200 and (put.json()["fusion"], put.json()["fusion_origin"]) == (shown, "space")
        assert (await SpaceStore(runtime.pool).spaces())[0].fusion == shown

        assert (await client.put(f"/v1/spaces/{key}/fusion", json={"kind": "convex", "alpha": 2})).status_code == 422
        assert (await client.put(f"/v1/spaces/{key}/fusion", json={"kind": "bm25f"})).status_code == 422
        misnamed = await client.put(f"/v1/spaces/{key}/fusion", json={**OWN, "block_weights": {"bge": 2}})
        assert misnamed.status_code == 422 and "no block 'bge'" in misnamed.json()["detail"]
        per_language = {"kind": "query_language", "chinese": OWN, "other": {"kind": "convex", "alpha": 0.3}}
        put = await client.put(f"/v1/spaces/{key}/fusion", json=per_language)
        assert put.status_code == 200 and put.json()["fusion"]["other"]["alpha"] == 0.3
        by_spread = {"kind": "dbsf", "keyword_weight": 0.35, "vector_weight": 0.65}
        put = await client.put(f"/v1/spaces/{key}/fusion", json=by_spread)
        assert put.status_code == 200 and put.json()["fusion"] == {
            **by_spread,
            "block_weights": {},
            "cross_language_weights": {},
            "tuned_on": None,
        }
        assert (await client.put(f"/v1/spaces/{key}/fusion", json={**by_spread, "k": 5})).status_code == 422
        nested = {**per_language, "other": {"kind": "rrf", "cross_language_weights": {"use": 2}}}
        misnamed = await client.put(f"/v1/spaces/{key}/fusion", json=nested)
        assert misnamed.status_code == 422 and "no block 'use'" in misnamed.json()["detail"]
        assert (await client.put("/v1/spaces/no-such-model-1/fusion", json=OWN)).status_code == 404

        taken_back = await client.delete(f"/v1/spaces/{key}/fusion")
        assert taken_back.status_code == 200 and taken_back.json()["fusion_origin"] == "measured"
