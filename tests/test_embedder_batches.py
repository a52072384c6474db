"""The embedder service consumes ``doc.chunked`` in batches and embeds their documents at once: the
chunks of many documents share the provider's calls, as in the embedded mode. One document's
messages stay in order, a document whose text the provider refuses is recorded and dead-lettered
alone, and a poison record in a batch is dead-lettered while the rest proceed. In memory
(FastStream's ``TestKafkaBroker``) on the real database, then over a real broker."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from faststream.kafka import TestKafkaBroker

from ragstream.connectors.folder import FolderConnector
from ragstream.embedding.base import EmbeddingError, TextKind, Vectors
from ragstream.embedding.coalescing import BatchLimits
from ragstream.jobs.sync import SyncJob
from ragstream.kafka import consumer_options, create_broker
from ragstream.messages import ChunksEmbedded, DeadLetter, DocumentChanged, DocumentChunked, DocumentDeleted, Topic
from ragstream.poison import PoisonGuard
from ragstream.runtime import Runtime
from ragstream.service import ServiceContext
from ragstream.stages.embed import EmbedService
from ragstream.stages.fetch import FetchService
from ragstream.storage.downstream import DownstreamStore
from ragstream.transport.kafka import KafkaTransport
from ragstream_embedder.main import register_handlers
from tests.support.pipeline import KafkaLag
from tests.support.stages import kafka_stages

pytestmark = pytest.mark.integration

_WAIT_S = 60.0


class CountingEmbedder:
    """The runtime's model with provider batches of 64 texts; notes the texts of each call that
    returned vectors, refuses for good any call holding a text with ``rejected``, and can hold its
    first call until released."""

    batch_limits = BatchLimits(batch_size=64)

    def __init__(self, runtime: Runtime) -> None:
        self._inner = runtime.embedder
        self.model_key, self.dimension = runtime.embedder.model_key, runtime.embedder.dimension
        self.calls: list[list[str]] = []
        self.hold_first = False
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def warm_up(self) -> None:
        await self._inner.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if self.hold_first and not self.holding.is_set():
            self.holding.set()
            await self.release.wait()
        if any("rejected" in text for text in texts):
            raise EmbeddingError("input rejected (400)", retryable=False, provider="test")
        vectors = await self._inner.embed(texts, kind)
        self.calls.append(list(texts))
        return vectors

    def call_of(self, word: str) -> int:
        """The index of the call that embedded the text containing ``word``."""
        return next(number for number, call in enumerate(self.calls) if any(word in text for text in call))

    async def aclose(self) -> None:
        """The inner model belongs to the runtime."""


class Collected:
    """A change sink that keeps what the fetch announced."""

    def __init__(self) -> None:
        self.changes: list[DocumentChanged] = []

    async def changed(self, message: DocumentChanged) -> None:
        self.changes.append(message)

    async def deleted(self, message: DocumentDeleted) -> None:
        raise AssertionError("nothing is deleted here")


async def chunked(runtime: Runtime, folder: Path) -> list[DocumentChunked]:
    """The ``doc.chunked`` messages of ``folder``'s documents, registered and staged as a sync does."""
    fetch = FetchService(runtime.store, FolderConnector(folder), max_document_bytes=runtime.settings.max_document_bytes)
    await fetch.register()
    collected = Collected()
    await fetch.run(collected)
    return [message for change in collected.changes for message in await runtime.chunker.run(change)]


def halves(message: DocumentChunked) -> list[DocumentChunked]:
    """One document's single batch split in two messages, as the chunker does for a long document."""
    middle = len(message.chunks) // 2
    return [
        message.model_copy(update={"batch_count": 2, "chunks": message.chunks[:middle]}),
        message.model_copy(update={"batch_index": 1, "batch_count": 2, "chunks": message.chunks[middle:]}),
    ]


class Embedder:
    """The embedder service's handler on FastStream's in-memory broker, over ``runtime`` with a
    ``CountingEmbedder``; keeps what it publishes."""

    def __init__(self, runtime: Runtime) -> None:
        self.counting = CountingEmbedder(runtime)
        self.broker = create_broker("127.0.0.1:9", "embedder")  # never connected: the test broker stands in
        self.broker.add_middleware(PoisonGuard)
        register_handlers(self.broker, consumer_options(runtime.settings, "embedder"))
        service = ServiceContext("embedder", replace(runtime, embed=EmbedService(self.counting)), self.broker)
        self.broker.context.set_global("service", service)
        self.embedded: list[ChunksEmbedded] = []
        self.letters: list[DeadLetter] = []
        self.broker.subscriber(Topic.CHUNK_EMBEDDED.value, group_id="test-indexer")(self._embedded)
        self.broker.subscriber(Topic.DEAD_LETTER.value, group_id="test-dead-letters")(self._letter)

    async def _embedded(self, message: ChunksEmbedded) -> None:
        self.embedded.append(message)

    async def _letter(self, message: DeadLetter) -> None:
        self.letters.append(message)

    async def consume(self, messages: Sequence[DocumentChunked | bytes]) -> None:
        """``messages`` as one batch of ``doc.chunked`` records."""
        async with TestKafkaBroker(self.broker) as memory:
            await memory.publish_batch(*messages, topic=Topic.DOC_CHUNKED.value)


async def test_a_batch_shares_calls_keeps_each_document_in_order_and_drops_poison(
    runtime: Runtime, tmp_path: Path
) -> None:
    for number in range(6):
        (tmp_path / f"plover-{number}.md").write_text(f"# Plover {number}\n\nPlover {number} runs along the shore.\n")
    first, second = "The godwit probes the mud. " * 40, "The godwit flies far. " * 40
    (tmp_path / "godwit.md").write_text(f"# Godwit\n\n## Firsthalf\n\n{first}\n\n## Secondhalf\n\n{second}\n")
    embedder = Embedder(runtime)
    try:
        messages: list[DocumentChunked | bytes] = []
        for message in await chunked(runtime, tmp_path):
            messages.extend(halves(message) if message.header.source == "godwit.md" else [message])
        messages.insert(3, b"\xff\xfe not JSON")
        await embedder.consume(messages)

        # The plovers and the godwit's first half went out in one call; its second half waited for it.
        calls = embedder.counting
        assert len(calls.calls) == 2, calls.calls
        assert {calls.call_of(f"Plover {number}") for number in range(6)} == {calls.call_of("Firsthalf")} == {0}
        assert calls.call_of("Secondhalf") == 1
        godwit = [message.batch_index for message in embedder.embedded if message.header.source == "godwit.md"]
        assert godwit == [0, 1]
        assert len(embedder.embedded) == 8
        [letter] = embedder.letters
        assert (letter.code, letter.header) == ("undecodable_message", None)
    finally:
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", FolderConnector(tmp_path).connection_id)


async def test_a_refused_document_in_a_batch_fails_alone(runtime: Runtime, tmp_path: Path) -> None:
    for number in range(3):
        (tmp_path / f"knot-{number}.md").write_text(f"# Knot {number}\n\nKnot {number} feeds on the flats.\n")
    (tmp_path / "rejected.md").write_text("# Rejected\n\nThe rejected page is refused by the provider.\n")
    connection_id = FolderConnector(tmp_path).connection_id
    embedder = Embedder(runtime)
    try:
        await embedder.consume(await chunked(runtime, tmp_path))

        assert sorted(message.header.source for message in embedder.embedded) == [f"knot-{n}.md" for n in range(3)]
        [letter] = embedder.letters
        assert letter.header is not None
        assert (letter.code, letter.step, letter.header.source) == ("embedding_rejected", "embed", "rejected.md")
        failures = await runtime.store.failures(connection_id)
        assert [(failure.source, failure.code) for failure in failures] == [("rejected.md", "embedding_rejected")]
    finally:
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection_id)


@pytest.fixture
async def folder(tmp_path: Path, runtime: Runtime) -> AsyncIterator[Path]:
    path = tmp_path / f"kb-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    await runtime.pool.execute("DELETE FROM connections WHERE id = $1", FolderConnector(path).connection_id)


@pytest.mark.kafka
async def test_the_kafka_embedder_fills_calls_across_documents(
    runtime: Runtime, kafka_bootstrap: str, folder: Path
) -> None:
    """20 documents of one chunk each, announced while the first call is held: without batches they
    would take 20 calls, one per message; the batches take far fewer. Then a refused document fails
    alone and the others index."""
    documents = 20
    for number in range(documents):
        (folder / f"curlew-{number:02}.md").write_text(f"# Curlew {number}\n\nCurlew {number} calls over the moor.\n")
    embedder = CountingEmbedder(runtime)
    embedder.hold_first = True
    stages = replace(runtime, embed=EmbedService(embedder))
    async with kafka_stages(stages, kafka_bootstrap) as broker, KafkaLag(kafka_bootstrap) as lag:
        transport = KafkaTransport(broker, DownstreamStore(runtime.pool), poll_interval_s=0.05)
        job = SyncJob(runtime.store, transport, max_document_bytes=runtime.settings.max_document_bytes)
        before = await lag.end(Topic.DOC_CHUNKED)
        sync = asyncio.create_task(job.sync(FolderConnector(folder)))
        await asyncio.wait_for(embedder.holding.wait(), _WAIT_S)
        deadline = time.monotonic() + _WAIT_S
        while await lag.end(Topic.DOC_CHUNKED) < before + documents:
            assert time.monotonic() < deadline, "the chunker did not announce every document"
            await asyncio.sleep(0.1)
        embedder.release.set()
        report = await asyncio.wait_for(sync, _WAIT_S)

        assert report.ok and report.progress.indexed == documents
        assert sum(len(call) for call in embedder.calls) == documents
        assert len(embedder.calls) <= documents // 4, [len(call) for call in embedder.calls]

        (folder / "rejected.md").write_text("# Rejected\n\nThe rejected page is refused by the provider.\n")
        for number in range(5):
            page = folder / f"curlew-{number:02}.md"
            page.write_text(f"# Curlew {number}\n\nCurlew {number} nests in heather.\n")
        report = await asyncio.wait_for(job.sync(FolderConnector(folder)), _WAIT_S)

    assert report.progress.indexed == 5
    assert [(failure.source, failure.code) for failure in report.failures] == [("rejected.md", "embedding_rejected")]
