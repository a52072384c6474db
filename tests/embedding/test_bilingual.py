"""The default bilingual embedder: BGE small v1.5 of each text's language and BGE small zh v1 beside USE as
three blocks of one vector, three HNSW indexes, three vector legs; a sync and search of the bundled knowledge base in
both languages and across them. The previous default (one BGE block) still builds for its stored spaces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.core.vectors import BILINGUAL_MODEL_KEY, BILINGUAL_PAIR_MODEL_KEY, BLOCKS
from ragstream.embedding import create_embedder
from ragstream.embedding.bilingual import BilingualEmbedder, LanguageModels, is_chinese
from ragstream.embedding.local import LocalUSEEmbedder
from ragstream.embedding.onnx import OnnxEmbedder
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import open_runtime
from ragstream.settings import EmbeddingSettings, Settings
from tests.support.connections import private_database

# The BGE models come from Maven Central once, like the onnx provider's tests.
pytestmark = pytest.mark.usefixtures("private_networks")

REPOSITORY = Path(__file__).resolve().parents[2]
MODEL_DIR = REPOSITORY / ".cache" / "models"
KNOWLEDGE_BASE = REPOSITORY / "examples" / "knowledge-base"


def test_the_default_embedder_is_the_bilingual_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGSTREAM_EMBEDDER_PROVIDER", raising=False)  # the suite's own choice, not the default
    embedder = create_embedder(EmbeddingSettings(model_dir=MODEL_DIR))
    assert isinstance(embedder, BilingualEmbedder)
    assert (embedder.model_key, embedder.dimension) == (BILINGUAL_PAIR_MODEL_KEY, 1536)


def test_the_previous_default_still_builds_the_space_it_stored() -> None:
    embedder = create_embedder(EmbeddingSettings(provider="bilingual", model_dir=MODEL_DIR))
    assert (embedder.model_key, embedder.dimension) == (BILINGUAL_MODEL_KEY, 1024)


def test_a_text_is_chinese_when_its_han_characters_outweigh_its_latin_letters() -> None:
    assert is_chinese("婚假可以休几天？")
    assert is_chinese("App 灰度发布的放量比例和崩溃率要求是什么？")
    assert not is_chinese("How many days of marriage leave can I take?")
    assert not is_chinese("The 北风实验室 handbook says the guest Wi-Fi password changes every Monday.")
    assert not is_chinese("NW-SEC-042")
    assert not is_chinese("")


async def test_each_text_gets_the_bge_models_of_its_language_and_use_each_in_its_own_block() -> None:
    use = LocalUSEEmbedder()
    chinese_v15, english_v15, chinese_v1 = (
        OnnxEmbedder(name, MODEL_DIR) for name in ("bge-small-zh-v1.5", "bge-small-en-v1.5", "bge-small-zh")
    )
    embedder = BilingualEmbedder(
        use,
        LanguageModels(chinese_v15, english_v15),
        LanguageModels(chinese_v1),
        model_key=BILINGUAL_PAIR_MODEL_KEY,
    )
    texts = ["婚假可以休几天？", "How many days of marriage leave can I take?"]

    vectors = await embedder.embed(texts, "query")

    first, second, use_block = BLOCKS[BILINGUAL_PAIR_MODEL_KEY]
    assert vectors.shape == (2, embedder.dimension) == (2, 1536)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx([1.0, 1.0], abs=1e-5)
    scale = math.sqrt(3.0)
    np.testing.assert_allclose(
        first.of(vectors)[0] * scale, (await chinese_v15.embed(texts[:1], "query"))[0], atol=1e-5
    )
    np.testing.assert_allclose(
        second.of(vectors)[0] * scale, (await chinese_v1.embed(texts[:1], "query"))[0], atol=1e-5
    )
    assert float(first.of(vectors)[0] @ second.of(vectors)[0]) * 3 < 0.9  # two models, two views of one question
    english = (await english_v15.embed(texts[1:], "query"))[0]
    for block in (first, second):  # no English model in the second block: the first's vector again
        np.testing.assert_allclose(block.of(vectors)[1][:384] * scale, english, atol=1e-5)
        assert not block.of(vectors)[1][384:].any()  # BGE small en is 384-d: the rest of its block stays 0
    np.testing.assert_allclose(use_block.of(vectors) * scale, await use.embed(texts, "query"), atol=1e-5)
    await embedder.aclose()


def test_a_bilingual_space_takes_as_many_bge_generations_as_it_has_blocks() -> None:
    chinese = OnnxEmbedder("bge-small-zh-v1.5", MODEL_DIR)
    models = LanguageModels(chinese, OnnxEmbedder("bge-small-en-v1.5", MODEL_DIR))
    with pytest.raises(ValueError, match="2 BGE blocks, not 1"):
        BilingualEmbedder(LocalUSEEmbedder(), models, model_key=BILINGUAL_PAIR_MODEL_KEY)
    with pytest.raises(ValueError, match="the first BGE block needs a model"):
        BilingualEmbedder(LocalUSEEmbedder(), LanguageModels(chinese), model_key=BILINGUAL_MODEL_KEY)
    assert BilingualEmbedder(LocalUSEEmbedder(), models, model_key=BILINGUAL_MODEL_KEY).dimension == 1024


def _queries(name: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in (REPOSITORY / "examples" / name).read_text().splitlines() if line.strip()]


async def test_the_bundled_knowledge_base_is_found_in_each_language_and_across_them(database_url: str) -> None:
    """Every sample query (15 English, 15 Chinese) finds its page in the top 10 with the default space,
    whose three block indexes exist, and so do at least 24 of the 26 cross-lingual ones (a Chinese question
    for an English page and the reverse; 26 when measured, 9 for the USE space at its own fusion): only the
    USE block finds those, and the space's fusion weighs its hits in the other language high."""
    embedding = EmbeddingSettings(provider="bilingual-pair", model_dir=MODEL_DIR)
    async with private_database(database_url) as dsn, open_runtime(Settings(embedding=embedding), dsn) as runtime:
        connector = FolderConnector(KNOWLEDGE_BASE)
        report = await runtime.pipeline().sync(connector)
        assert report.ok, report.failures
        table = await runtime.pool.fetchval(
            "SELECT table_name FROM embedding_spaces WHERE model_key = $1", BILINGUAL_PAIR_MODEL_KEY
        )
        indexes = await runtime.pool.fetch("SELECT indexdef FROM pg_indexes WHERE tablename = $1", table)
        assert sorted(row["indexdef"].count("subvector(embedding") for row in indexes) == [0, 1, 1, 1]  # 3 blocks

        async def found(query: dict[str, str]) -> bool:
            response = await runtime.retriever.search(
                SearchRequest(query=query["query"], filters=SearchFilters(connection_ids=[connector.connection_id]))
            )
            assert response.embedding_spaces == [BILINGUAL_PAIR_MODEL_KEY]
            return query["expected_source"] in [result.source for result in response.results]

        same_language = [query["id"] for query in _queries("sample-queries.jsonl") if not await found(query)]
        across = [query["id"] for query in _queries("cross-lingual-queries.jsonl") if await found(query)]
    assert same_language == []
    assert len(across) >= 24, across
