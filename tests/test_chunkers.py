"""The four chunkers, their per-connection config, and the size limit every chunk respects."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from ragstream.chunking import (
    Chunker,
    EstimatedTokenizer,
    MarkdownChunker,
    MarkdownChunking,
    RecursiveChunker,
    RecursiveChunking,
    SemanticChunker,
    SemanticChunking,
    TokenChunker,
    TokenChunking,
    create_chunker,
    parse_chunking,
    tokenizer_for,
)
from ragstream.chunking.base import split_sections
from ragstream.chunking.semantic import breakpoints, split_sentences
from ragstream.cli import app
from ragstream.connectors.folder import FolderConnector
from ragstream.embedding.base import TextKind, Vectors
from ragstream.embedding.local import LocalUSEEmbedder, USETokenizer
from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument
from ragstream.runtime import Runtime

SENTENCE = "The on-call engineer acknowledges the page within fifteen minutes and posts updates. "
CHINESE = "值班工程师需要在十五分钟内响应告警并在群里同步进展。"
DOCUMENT = (
    "# Guide\n\nIntro to the guide.\n\n"
    f"## Install\n\n{SENTENCE * 30}\n\n"
    "### Linux\n\napt install ragstream\n\n"
    f"## 值班\n\n{CHINESE * 40}\n\n"
    "## Code\n\n```bash\n# not a heading\nsystemctl restart kafka\n```\n\n"
    f"## Tail\n\n{'supercalifragilistic' * 40} {SENTENCE * 5}"
)


class FakeEmbedder:
    """Sentences about one topic get one direction, so the distance only jumps between topics."""

    model_key = "fake-topics-8"
    dimension = 8
    topics = ("cat", "rocket", "bread")

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def warm_up(self) -> None:
        return None

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        self.calls.append(list(texts))
        vectors = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            topic = next((i for i, word in enumerate(self.topics) if word in text.lower()), len(self.topics))
            vectors[row, topic] = 1.0
            vectors[row, 4 + len(text) % 4] = 0.05  # a little jitter inside a topic
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def use_tokenizer() -> USETokenizer:
    """The real sentencepiece tokenizer of the local USE model (loading it takes a few seconds)."""
    tokenizer = LocalUSEEmbedder().tokenizer()
    tokenizer.warm_up()
    return tokenizer


def heading_paths(markdown: str) -> dict[str, str]:
    """Each section's first line mapped to its heading path, from the shared section splitter."""
    return {section.text.split("\n", 1)[0]: section.heading for section in split_sections(markdown)}


def words(text: str) -> set[str]:
    """The words a chunker must not lose (one longer than any chunk is necessarily cut)."""
    return {word for word in re.split(r"[\s。]+", text) if word and not word.startswith("#") and len(word) < 50}


def assert_ordinals(chunks: list[ChunkPayload]) -> None:
    assert [chunk.ordinal for chunk in chunks] == list(range(len(chunks)))


@pytest.mark.parametrize(("size", "overlap"), [(512, 0), (128, 16), (40, 0), (16, 4)])
async def test_token_chunks_fit_the_use_tokenizer(use_tokenizer: USETokenizer, size: int, overlap: int) -> None:
    chunks = await TokenChunker(size, overlap, use_tokenizer).run_async(ParsedDocument("t", DOCUMENT))
    assert_ordinals(chunks)
    counts = [use_tokenizer.count(chunk.text) for chunk in chunks]
    assert max(counts) <= size
    assert words(DOCUMENT) <= set().union(*(words(chunk.text) for chunk in chunks)) or size < 24
    if size == 512:  # headings first: the short sections are merged, the long ones are split
        assert max(counts) > 256
        assert chunks[0].heading == "Guide"


def test_the_local_embedder_lends_its_tokenizer_and_remote_ones_get_an_estimate(use_tokenizer: USETokenizer) -> None:
    assert isinstance(tokenizer_for(LocalUSEEmbedder()), USETokenizer)
    assert isinstance(tokenizer_for(FakeEmbedder()), EstimatedTokenizer)
    assert use_tokenizer.count("") == 0
    assert use_tokenizer.count("Hello world.") == 3  # ▁Hello ▁world . (no <s> and </s>)
    estimate = EstimatedTokenizer()
    assert estimate.count("值班工程师") == 5
    assert estimate.count("abcdef") == 2
    assert estimate.count(SENTENCE) >= use_tokenizer.count(SENTENCE)  # an overestimate for English


@pytest.mark.parametrize(("size", "overlap"), [(1500, 100), (400, 50), (200, 0), (100, 30)])
def test_recursive_chunks_are_full_bounded_and_overlap(size: int, overlap: int) -> None:
    chunks = RecursiveChunker(size, overlap).run(ParsedDocument("t", DOCUMENT))
    assert_ordinals(chunks)
    assert max(len(chunk.text) for chunk in chunks) <= size
    assert words(DOCUMENT) <= set().union(*(words(chunk.text) for chunk in chunks))
    if overlap:  # a chunk cut inside the long English section repeats the end of the one before it
        english = [chunk.text for chunk in chunks if chunk.text.startswith(("The on-call", "acknowledges"))]
        assert any(text[:30] in previous for previous, text in itertools.pairwise(english))


def test_recursive_runs_across_headings_and_names_the_section_it_starts_in() -> None:
    markdown = "# Guide\n\nIntro.\n\n## Install\n\nRun it.\n\n## Use\n\n" + "Call it often. " * 20
    chunks = RecursiveChunker(200, 0).run(ParsedDocument("t", markdown))
    assert chunks[0].heading == "Guide" and "## Install" in chunks[0].text  # size first: headings don't cut
    assert [chunk.heading for chunk in chunks[1:]] == ["Guide > Use"] * (len(chunks) - 1)


@pytest.mark.parametrize(
    ("distances", "threshold_type", "amount", "expected"),
    [
        ([0.1, 0.1, 0.9, 0.1, 0.1], "percentile", 95, [2]),
        ([0.1, 0.1, 0.9, 0.1, 0.1], "percentile", 50, [2]),
        ([0.1, 0.2, 0.3, 0.4, 0.5], "percentile", 50, [3, 4]),
        ([0.0] * 10 + [1.0] + [0.0] * 10, "std", 3, [10]),
        ([0.0] * 4 + [1.0] + [0.0] * 4, "std", 3, []),  # too few distances for a 3-sigma outlier
        ([0.1, 0.12, 0.11, 0.8, 0.1, 0.13], "iqr", 1.5, [3]),
        ([0.2, 0.2, 0.2, 0.2], "iqr", 1.5, []),
        ([0.1, 0.1, 0.9, 0.1, 0.1], "gradient", 95, [2]),  # the rise, not the sentence before it
        ([0.1, 0.2, 0.3, 0.4, 0.9, 0.5], "gradient", 80, [4]),  # a drifting baseline is no break
        ([], "percentile", 95, []),
    ],
)
def test_breakpoints(distances: list[float], threshold_type: Any, amount: float, expected: list[int]) -> None:
    assert breakpoints(distances, threshold_type, amount) == expected


def test_sentences_split_in_english_and_chinese_and_keep_headings_and_list_numbers() -> None:
    text = "## Steps\n\n1. Fetch it. Then parse!\n2. Chunk it? In 2024. 值班需要响应。并同步进展！Done\n\nNext"
    sentences = split_sentences(text)
    assert [s.text for s in sentences] == [
        "## Steps\n\n1. Fetch it.",
        "Then parse!",
        "2. Chunk it?",
        "In 2024.",
        "值班需要响应。",
        "并同步进展！",
        "Done",
        "Next",
    ]
    assert all(text[s.start : s.start + len(s.text)] == s.text for s in sentences)


TOPICS = "# Notes\n\n" + " ".join(
    [f"The cat {verb}." for verb in ("sleeps", "purrs", "eats", "plays", "naps", "hides", "stretches", "yawns")]
    + [f"The rocket {verb}." for verb in ("launches", "climbs", "burns", "stages", "orbits", "lands", "flies", "docks")]
    + [f"The bread {verb}." for verb in ("rises", "bakes", "cools", "browns", "crusts", "rests", "proves", "keeps")]
)


@pytest.mark.parametrize(
    ("threshold_type", "amount"),
    [("percentile", None), ("percentile", 90), ("std", None), ("std", 2), ("iqr", None), ("gradient", None)],
)
async def test_semantic_breaks_where_the_topic_changes(threshold_type: Any, amount: float | None) -> None:
    embedder = FakeEmbedder()
    chunker = SemanticChunker(embedder, threshold_type, amount, size=512)
    chunks = await chunker.run_async(ParsedDocument("t", TOPICS))
    assert_ordinals(chunks)
    assert [chunk.text.split()[-2:] for chunk in chunks] == [
        ["cat", "yawns."],
        ["rocket", "docks."],
        ["bread", "keeps."],
    ]
    assert chunks[0].text.startswith("# Notes\n\nThe cat sleeps.")
    assert {chunk.heading for chunk in chunks} == {"Notes"}
    assert len(embedder.calls) == 1 and len(embedder.calls[0]) == 24  # one call, one text per sentence


async def test_semantic_keeps_headings_as_breaks_and_resplits_oversize_pieces() -> None:
    one_topic = " ".join(f"The cat number {n} sleeps all day long in the warm sun." for n in range(60))
    markdown = f"# Pets\n\n## Cats\n\n{one_topic}\n\n## Rockets\n\nThe rocket launches. The rocket lands."
    chunks = await SemanticChunker(FakeEmbedder(), size=64).run_async(ParsedDocument("t", markdown))
    tokens = EstimatedTokenizer()
    assert max(tokens.count(chunk.text) for chunk in chunks) <= 64
    cats = [chunk for chunk in chunks if chunk.heading == "Pets > Cats"]
    rockets = [chunk for chunk in chunks if chunk.heading == "Pets > Rockets"]
    assert chunks[0].heading == "Pets" and chunks[0].text.startswith("# Pets\n\n## Cats\n\nThe cat number 0")
    assert len(cats) > 10 and len(chunks) == 1 + len(cats) + len(rockets)
    assert all("rocket" not in chunk.text for chunk in cats)  # a heading is always a break
    assert rockets[0].text.startswith("## Rockets\n\nThe rocket launches.")


def chunkers(tokenizer: USETokenizer, size: int) -> list[tuple[Chunker, Any]]:
    """Every chunker at ``size`` with the measure of its unit."""
    return [
        (MarkdownChunker(size, size // 10), len),
        (RecursiveChunker(size, size // 10), len),
        (TokenChunker(size // 4, 0, tokenizer), tokenizer.count),
        (SemanticChunker(FakeEmbedder(), size=size // 4, tokenizer=tokenizer), tokenizer.count),
    ]


LINES = st.lists(
    st.one_of(
        st.sampled_from(["# A", "## B", "### C", "```", "", "。", "Sentence. ", "中文句子。", "1. item"]),
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=300),
    ),
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(LINES, st.sampled_from([100, 150, 400]))
def test_character_chunkers_never_exceed_the_size_and_lose_no_words(lines: list[str], size: int) -> None:
    markdown = "\n".join(lines)
    for chunker in (MarkdownChunker(size, size // 5), RecursiveChunker(size, size // 5)):
        chunks = chunker.run(ParsedDocument("t", markdown))
        assert all(0 < len(chunk.text) <= size for chunk in chunks)
        joined = "".join(chunk.text for chunk in chunks)
        assert all(word in joined for word in markdown.split() if not word.startswith("#") and len(word) < size // 2)


@settings(max_examples=25, deadline=None)
@given(LINES)
def test_token_chunks_never_exceed_the_size(use_tokenizer: USETokenizer, lines: list[str]) -> None:
    chunks = TokenChunker(24, 4, use_tokenizer).run(ParsedDocument("t", "\n".join(lines)))
    assert all(0 < use_tokenizer.count(chunk.text) <= 24 for chunk in chunks)


@pytest.mark.parametrize("size", [100, 300, 1500])
async def test_no_chunker_emits_an_oversize_chunk(use_tokenizer: USETokenizer, size: int) -> None:
    # A heading glued to the text after it used to push a Markdown chunk over the size.
    tricky = DOCUMENT + "\n\n## " + "Long heading words " * 4 + "\n\n" + "x" * (size - 5) + " tail.\n"
    for chunker, measure in chunkers(use_tokenizer, size):
        chunks = await chunker.run_async(ParsedDocument("t", tricky))
        limit = size if measure is len else size // 4
        assert max(measure(chunk.text) for chunk in chunks) <= limit, type(chunker).__name__
        assert all(chunk.text.strip() for chunk in chunks)


async def test_every_chunker_keeps_the_heading_path_of_where_a_chunk_starts(use_tokenizer: USETokenizer) -> None:
    paths = heading_paths(DOCUMENT)
    for chunker, _ in chunkers(use_tokenizer, 400):
        chunks = await chunker.run_async(ParsedDocument("t", DOCUMENT))
        headed = [chunk for chunk in chunks if chunk.text.startswith("#")]
        assert {chunk.heading for chunk in chunks} >= {"Guide > Install", "Guide > 值班"}, type(chunker).__name__
        for chunk in headed:
            first_line = chunk.text.split("\n", 1)[0]
            if first_line in paths:
                assert chunk.heading == paths[first_line], (type(chunker).__name__, first_line)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"kind": "markdown"}, MarkdownChunking(size=1500, overlap=100)),
        ({"kind": "token"}, TokenChunking(size=512, overlap=0)),
        ('{"kind": "token", "size": 256, "overlap": 32}', TokenChunking(size=256, overlap=32)),
        ({"kind": "recursive", "size": 800}, RecursiveChunking(size=800, overlap=100)),
        ({"kind": "semantic"}, SemanticChunking(threshold_type="percentile", size=512)),
        ({"kind": "semantic", "threshold_type": "iqr", "threshold_amount": 2}, SemanticChunking(threshold_type="iqr")),
    ],
)
def test_config_variants_parse_by_kind(data: Any, expected: Any) -> None:
    config = parse_chunking(data)
    assert type(config) is type(expected)
    assert config.size == expected.size and config.overlap == expected.overlap
    assert parse_chunking(config.model_dump(mode="json")) == config  # what is stored reads back the same


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "sentence"},
        {"kind": "token", "size": 512, "overlap": 512},
        {"kind": "token", "size": 8},
        {"kind": "markdown", "size": 50},
        {"kind": "semantic", "threshold_type": "percentile", "threshold_amount": 120},
        {"kind": "semantic", "threshold_type": "mad"},
        {"kind": "semantic", "overlap": 10},
        {"kind": "recursive", "chunk_size": 100},
    ],
)
def test_invalid_configs_are_rejected(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse_chunking(data)


def test_the_factory_builds_each_kind_and_semantic_defaults_its_amount() -> None:
    embedder = FakeEmbedder()
    built = [
        create_chunker(parse_chunking({"kind": kind}), embedder)
        for kind in ("markdown", "token", "recursive", "semantic")
    ]
    assert [type(chunker) for chunker in built] == [MarkdownChunker, TokenChunker, RecursiveChunker, SemanticChunker]
    semantic = create_chunker(SemanticChunking(threshold_type="std"), embedder)
    assert isinstance(semantic, SemanticChunker) and semantic.threshold_amount == 3.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chunk-size", "100"], "need --chunker"),
        (["--chunker", "token", "--chunk-size", "4"], "greater than or equal to 16"),
        (["--chunker", "markdown", "--chunk-size", "200", "--chunk-overlap", "300"], "overlap must be smaller"),
        (["--chunker", "fancy"], "fancy"),
    ],
)
def test_ingest_rejects_bad_chunking_options_before_touching_anything(
    corpus: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["ingest", str(corpus), *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.integration
async def test_a_connection_chunked_by_tokens_stores_chunks_within_the_limit(
    runtime: Runtime, corpus: Path, use_tokenizer: USETokenizer
) -> None:
    connection = FolderConnector(corpus).connection_id
    try:
        (corpus / "guide.md").write_text(DOCUMENT)
        config = {"chunking": TokenChunking(size=64, overlap=8).model_dump(mode="json")}
        report = await runtime.pipeline().sync(FolderConnector(corpus, config))
        assert report.ok, report.failures
        assert await runtime.store.connection_config(connection) == config

        # A later sync without options keeps the connection's chunker for new files.
        (corpus / "notes.md").write_text(f"# Notes\n\n{SENTENCE * 12}")
        assert (await runtime.pipeline().sync(FolderConnector(corpus))).ok
        rows = await runtime.pool.fetch(
            "SELECT d.source, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.connection_id = $1",
            connection,
        )
        assert {row["source"] for row in rows} == {"guide.md", "notes.md"}
        counts = [use_tokenizer.count(row["text"]) for row in rows]
        assert max(counts) <= 64 and len(rows) > 20
        assert {"Guide > Install", "Guide > 值班", "Notes"} <= {row["heading"] for row in rows}
        assert await runtime.store.connection_config(connection) == config
    finally:  # the session shares one database: leave nothing for other tests' unscoped searches
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection)
