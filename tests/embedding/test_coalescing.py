"""CoalescingEmbedder: the embed calls of many documents share full provider batches, failures stay per caller."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pytest

from ragstream.embedding.base import Embedder, EmbeddingError, TextKind, Vectors
from ragstream.embedding.coalescing import BatchLimits, CoalescingEmbedder, batch_limits
from ragstream.embedding.dashscope import MAX_BATCH_SIZE, DashScopeEmbedder
from ragstream.embedding.local import LocalUSEEmbedder
from ragstream.messages import ChunkPayload, DocumentChunked, DocumentHeader
from ragstream.stages.embed import EmbedService, embedding_text
from tests.support.embedders import hash_vector

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

pytest_plugins = ["tests.support.fake_dashscope"]


class RecordingEmbedder:
    """Hashed-word vectors; records each call's texts and how many calls ran at once, and refuses
    (permanently) any call holding a text with ``poison`` or fails (retryably) one with ``flaky``."""

    model_key = "test-recording-16"
    dimension = 16

    def __init__(self, delay_s: float = 0.005) -> None:
        self.delay_s = delay_s
        self.calls: list[tuple[TextKind, list[str]]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def warm_up(self) -> None:
        return None

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        self.calls.append((kind, list(texts)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if any("poison" in text for text in texts):
            raise EmbeddingError("test: the provider refused an input", retryable=False, provider="test")
        if any("flaky" in text for text in texts):
            raise EmbeddingError("test: the provider is down", retryable=True, provider="test")
        return np.vstack([hash_vector(text, self.dimension) for text in texts])

    async def aclose(self) -> None:
        return None

    def document_calls(self) -> list[list[str]]:
        return [texts for kind, texts in self.calls if kind == "document"]


def documents(count: int, seed: int = 7) -> list[list[str]]:
    """``count`` documents of 1 to 7 chunks each, every text unique."""
    rng = random.Random(seed)
    return [[f"document {d} chunk {c} words" for c in range(rng.randint(1, 7))] for d in range(count)]


def expected(texts: list[str], dimension: int = 16) -> Vectors:
    return np.vstack([hash_vector(text, dimension) for text in texts])


async def run_workers(embedder: Embedder, docs: list[list[str]], workers: int) -> list[Vectors]:
    """Embed each document with one call, ``workers`` documents at a time, as the pipeline does."""
    results: list[Vectors | None] = [None] * len(docs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(docs)):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            results[index] = await embedder.embed(docs[index])

    await asyncio.gather(*(worker() for _ in range(workers)))
    return [result for result in results if result is not None]


async def test_documents_share_full_batches_and_each_gets_its_own_rows() -> None:
    inner = RecordingEmbedder()
    coalescer = CoalescingEmbedder(inner, BatchLimits(batch_size=8, max_in_flight=2))
    docs = documents(60)
    results = await run_workers(coalescer, docs, workers=12)
    for texts, vectors in zip(docs, results, strict=True):
        np.testing.assert_allclose(vectors, expected(texts), rtol=1e-6)
    sizes = [len(texts) for texts in inner.document_calls()]
    assert sum(sizes) == sum(len(texts) for texts in docs)  # every text once
    # Full batches but for the last ones: a batch goes out part-full only when nothing is waiting.
    assert max(sizes) == 8 and sum(size < 8 for size in sizes) <= 2
    assert inner.max_in_flight == 2


async def test_texts_arriving_while_the_only_call_runs_wait_for_it_and_go_out_together() -> None:
    inner = RecordingEmbedder(delay_s=0.2)
    coalescer = CoalescingEmbedder(inner, BatchLimits(batch_size=4, max_in_flight=1, linger_s=0))
    first = asyncio.create_task(coalescer.embed(["a 1", "a 2", "a 3", "a 4"]))
    await asyncio.sleep(0.05)  # in flight, and the queue is empty again
    later = [asyncio.create_task(coalescer.embed([f"{name} 1"])) for name in ("b", "c", "d")]
    await asyncio.gather(first, *later)
    assert inner.document_calls() == [["a 1", "a 2", "a 3", "a 4"], ["b 1", "c 1", "d 1"]]
    assert inner.max_in_flight == 1


async def test_a_refused_text_fails_only_its_own_document() -> None:
    inner = RecordingEmbedder()
    coalescer = CoalescingEmbedder(inner, BatchLimits(batch_size=10, max_in_flight=1, linger_s=0.5))
    docs = [["alpha one", "alpha two"], ["beta poison"], ["gamma one", "gamma two", "gamma three"]]
    outcomes = await asyncio.gather(*(coalescer.embed(texts) for texts in docs), return_exceptions=True)
    assert isinstance(outcomes[1], EmbeddingError) and not outcomes[1].retryable
    np.testing.assert_allclose(outcomes[0], expected(docs[0]), rtol=1e-6)  # type: ignore[arg-type]
    np.testing.assert_allclose(outcomes[2], expected(docs[2]), rtol=1e-6)  # type: ignore[arg-type]
    # One shared call, refused; then each document's texts alone.
    assert inner.document_calls() == [[text for texts in docs for text in texts], *docs]


async def test_a_provider_outage_fails_every_document_of_the_batch_with_a_retryable_error() -> None:
    inner = RecordingEmbedder()
    coalescer = CoalescingEmbedder(inner, BatchLimits(batch_size=10, max_in_flight=1, linger_s=0.5))
    outcomes = await asyncio.gather(
        coalescer.embed(["alpha flaky"]), coalescer.embed(["beta one"]), return_exceptions=True
    )
    assert all(isinstance(outcome, EmbeddingError) and outcome.retryable for outcome in outcomes)
    assert len(inner.calls) == 1  # the provider's own retries already ran; no second round here
    np.testing.assert_allclose(await coalescer.embed(["beta one"]), expected(["beta one"]), rtol=1e-6)


async def test_a_cancelled_document_sends_no_more_texts() -> None:
    inner = RecordingEmbedder(delay_s=0.2)
    coalescer = CoalescingEmbedder(inner, BatchLimits(batch_size=4, max_in_flight=1, linger_s=0))
    first = asyncio.create_task(coalescer.embed([f"first {i}" for i in range(4)]))
    await asyncio.sleep(0.05)  # the first batch is in flight
    doomed = asyncio.create_task(coalescer.embed([f"doomed {i}" for i in range(8)]))
    kept = asyncio.create_task(coalescer.embed(["kept"]))
    await asyncio.sleep(0)
    doomed.cancel()
    np.testing.assert_allclose(await kept, expected(["kept"]), rtol=1e-6)
    await first
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert not any("doomed" in text for texts in inner.document_calls() for text in texts)


async def test_queries_do_not_wait_for_a_batch_to_fill() -> None:
    inner = RecordingEmbedder(delay_s=0.3)
    coalescer = CoalescingEmbedder(inner, BatchLimits(batch_size=64, max_in_flight=1, linger_s=10.0))
    lingering = asyncio.create_task(coalescer.embed(["a document chunk"]))  # waits up to 10 s for 63 more
    query = await coalescer.embed(["what is a chunk"], "query")
    np.testing.assert_allclose(query, expected(["what is a chunk"]), rtol=1e-6)
    assert inner.calls == [("query", ["what is a chunk"])]
    lingering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lingering


def test_providers_declare_their_limits() -> None:
    assert batch_limits(LocalUSEEmbedder()) == BatchLimits(batch_size=64, max_in_flight=1)
    dashscope = DashScopeEmbedder(api_key="sk-test", max_concurrency=5)
    assert batch_limits(dashscope) == BatchLimits(batch_size=MAX_BATCH_SIZE, max_in_flight=5)
    assert batch_limits(RecordingEmbedder()) is None  # an embedder without limits is called as is


@pytest.fixture
async def dashscope(fake_dashscope: FakeDashScope) -> AsyncIterator[DashScopeEmbedder]:
    embedder = DashScopeEmbedder(api_key=fake_dashscope.api_key, base_url=fake_dashscope.base_url, dimension=64)
    yield embedder
    await embedder.aclose()


@pytest.mark.usefixtures("private_networks")
async def test_dashscope_requests_are_full_across_documents_and_never_over_the_in_flight_limit(
    fake_dashscope: FakeDashScope, dashscope: DashScopeEmbedder
) -> None:
    """300 documents of about 4 chunks through the embed stage, 24 at a time as the pipeline runs
    them: requests of 10 texts across documents, 5 in flight and never more."""
    fake_dashscope.delay_s = 0.05
    rng = random.Random(11)
    service = EmbedService(dashscope)
    messages = [chunked(d, [f"page {d} part {c} text" for c in range(rng.randint(2, 6))]) for d in range(300)]
    queue: asyncio.Queue[DocumentChunked] = asyncio.Queue()
    for message in messages:
        queue.put_nowait(message)
    vectors: dict[str, Vectors] = {}

    async def worker() -> None:
        while not queue.empty():
            message = queue.get_nowait()
            embedded = await service.run(message)
            vectors[message.header.document_id] = np.frombuffer(embedded.vectors, dtype=np.float32).reshape(-1, 64)

    await asyncio.gather(*(worker() for _ in range(24)))

    sizes = [len(body["input"]["texts"]) for body in fake_dashscope.bodies()]
    total = sum(len(message.chunks) for message in messages)
    assert sum(sizes) == total
    assert sum(size < MAX_BATCH_SIZE for size in sizes) <= 5  # only the last round goes out part-full
    assert fake_dashscope.max_in_flight == 5
    for message in messages:
        texts = [embedding_text(message.header, chunk) for chunk in message.chunks]
        np.testing.assert_allclose(
            vectors[message.header.document_id], fake_dashscope.expected_vectors(texts, 64), atol=1e-6
        )


def chunked(number: int, texts: list[str]) -> DocumentChunked:
    header = DocumentHeader(
        document_id=f"doc-{number}",
        connection_id="connection",
        external_id=f"page-{number}.html",
        version=1,
        content_hash="0" * 64,
        title=f"Page {number}",
        source=f"page-{number}.html",
        media_type="text/html",
    )
    return DocumentChunked(
        header=header,
        batch_index=0,
        batch_count=1,
        chunk_count=len(texts),
        chunks=[ChunkPayload(ordinal=i, heading="", text=text) for i, text in enumerate(texts)],
        index_version=1,
    )
