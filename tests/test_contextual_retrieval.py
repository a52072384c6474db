"""Contextual retrieval against the fake DashScope chat: each chunk embedded with a line placing it in
its document, cached so unchanged chunks never ask again, and a failing model failing the document."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from ragstream.chat import ChatClient
from ragstream.connectors.folder import FolderConnector
from ragstream.contextual import ChunkContextualizer, TitledChunk
from ragstream.degradation import EmbeddingDegraded
from ragstream.embedding.base import TextKind, Vectors
from ragstream.messages import ChunkPayload, DocumentChunked, DocumentHeader
from ragstream.runtime import Runtime, create_contextualizer, open_runtime
from ragstream.settings import Settings
from ragstream.stages.embed import EmbedService, embedding_input
from ragstream.storage.chunk_contexts import ChunkContextStore
from tests.support.fake_dashscope import CHAT_PATH, situate

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

pytest_plugins = ["tests.support.fake_dashscope"]
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_networks")]


def contextual_settings(database_url: str, fake: FakeDashScope) -> Settings:
    return Settings(
        database_url=database_url,
        contextual_retrieval="dashscope",
        dashscope_api_key=fake.api_key,
        dashscope_base_url=fake.base_url,
    )


@pytest.fixture
async def contextual(database_url: str, fake_dashscope: FakeDashScope) -> AsyncIterator[Runtime]:
    async with open_runtime(contextual_settings(database_url, fake_dashscope), database_url) as opened:
        yield opened


def prompts(fake: FakeDashScope) -> list[str]:
    return [body["messages"][0]["content"] for body in fake.bodies(CHAT_PATH)]


class RecordingEmbedder:
    """Records what it is asked to embed; vectors are all ones."""

    model_key = "recording"
    dimension = 4

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        self.texts.extend(texts)
        return np.ones((len(texts), self.dimension), dtype=np.float32)


def test_off_by_default() -> None:
    settings = Settings()
    assert settings.contextual_retrieval == "none"
    assert create_contextualizer(settings, pool=None) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="RAGSTREAM_DASHSCOPE_API_KEY"):
        Settings(contextual_retrieval="dashscope")


async def test_each_chunk_is_embedded_after_its_context_line(runtime: Runtime, fake_dashscope: FakeDashScope) -> None:
    chat = ChatClient(fake_dashscope.api_key, base_url=f"{fake_dashscope.base_url}/compatible-mode/v1")
    contextualizer = ChunkContextualizer(chat, ChunkContextStore(runtime.pool))
    embedder = RecordingEmbedder()
    header = DocumentHeader.model_validate(
        {
            "document_id": "doc-billing",
            "connection_id": "conn",
            "external_id": "billing.md",
            "source": "billing.md",
            "title": "Billing service runbook",
            "version": 1,
            "content_hash": "h",
            "media_type": "text/markdown",
        }
    )
    chunks = [
        ChunkPayload(ordinal=0, heading="Restarts", text="It is restarted nightly at 02:00."),
        ChunkPayload(ordinal=1, heading="Owners", text="The payments team owns it."),
    ]
    message = DocumentChunked(header=header, batch_index=0, batch_count=1, chunk_count=2, chunks=chunks)
    try:
        await EmbedService(embedder, contextualizer=contextualizer).run(message)  # type: ignore[arg-type]
    finally:
        await contextualizer.aclose()

    sent = prompts(fake_dashscope)
    assert len(sent) == 2 and all("It is restarted nightly" in prompt for prompt in sent)  # the whole batch
    expected = [
        embedding_input(header.title, chunk.heading, chunk.text, situate(prompt) or "")
        for chunk, prompt in zip(chunks, sorted(sent, key=lambda p: "Owners" in p.split("<chunk>")[1]), strict=True)
    ]
    assert embedder.texts == expected
    assert embedder.texts[0].startswith("Part of the document Billing service runbook, on Restarts.\n")


async def test_unchanged_chunks_never_ask_again(
    contextual: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    (tmp_path / "a.md").write_text("# Alpha\n\nAlpha holds the first fact.\n")
    (tmp_path / "b.md").write_text("# Beta\n\nBeta holds the second fact.\n")
    connector = FolderConnector(tmp_path)
    assert (await contextual.pipeline().sync(connector)).ok
    first = len(prompts(fake_dashscope))
    assert first == 2

    # An unchanged re-sync reads nothing new; a re-chunk or re-index, embedding the stored chunks
    # again (``embedding_inputs`` over title, heading and text), finds every context in the cache.
    assert (await contextual.pipeline().sync(connector)).ok
    rows = await contextual.pool.fetch(
        "SELECT d.title, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
        " WHERE d.connection_id = $1",
        connector.connection_id,
    )
    assert contextual.contextualizer is not None
    stored = [TitledChunk(row["title"], row["heading"], row["text"]) for row in rows]
    contexts = await contextual.contextualizer.contexts(stored)
    assert sorted(contexts) == [
        "Part of the document Alpha, on Alpha.",
        "Part of the document Beta, on Beta.",
    ]
    assert len(prompts(fake_dashscope)) == first

    (tmp_path / "b.md").write_text("# Beta\n\nBeta now holds a changed fact.\n")
    assert (await contextual.pipeline().sync(connector)).ok
    asked = prompts(fake_dashscope)[first:]
    assert len(asked) == 1 and "Beta now holds a changed fact." in asked[0]


async def test_a_model_that_keeps_failing_fails_its_documents_with_the_reason(
    contextual: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    """Every chunk then lacks its vector, so the embedding guard stops the sync (nothing deleted); the
    document's row says why, and once the model answers again the next sync indexes it."""
    (tmp_path / "c.md").write_text("# Gamma\n\nGamma holds the third fact.\n")
    connector = FolderConnector(tmp_path)
    fake_dashscope.fail_next(50, status=400, code="InvalidParameter", message="Range of input length is [1, 6000]")

    with pytest.raises(EmbeddingDegraded):
        await contextual.pipeline().sync(connector)

    (failure,) = await contextual.store.failures(connector.connection_id)
    assert (failure.code, failure.step, failure.retryable) == ("context_unavailable", "embed", False)
    assert "InvalidParameter" in failure.message
    fake_dashscope.reset()
    report = await contextual.pipeline().sync(connector)
    assert report.ok and report.progress.indexed == 1


async def test_a_passing_outage_is_retried_within_the_sync(
    contextual: Runtime, fake_dashscope: FakeDashScope, tmp_path: Path
) -> None:
    (tmp_path / "d.md").write_text("# Delta\n\nDelta holds the fourth fact.\n")
    fake_dashscope.server_error_next(2)

    report = await contextual.pipeline().sync(FolderConnector(tmp_path))

    assert report.ok and report.progress.indexed == 1
