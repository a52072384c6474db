"""The Kafka stage handlers in memory (FastStream's ``TestKafkaBroker``) on the real database: the
indexer runs a document refused as stale by a switch again at once, as the in-memory transport does.
The same behaviour over a real broker is in ``tests/test_sync_transports.py``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from faststream.kafka import TestKafkaBroker

from ragstream.connectors.folder import FolderConnector
from ragstream.kafka import consumer_options, create_broker
from ragstream.messages import ChunksEmbedded, DocumentChanged, DocumentDeleted, DocumentIndexed, Topic
from ragstream.runtime import Runtime
from ragstream.service import ServiceContext
from ragstream.stages.fetch import FetchService
from ragstream.stages.index import IndexService
from ragstream.storage.documents import DocumentStore, StaleChunkingError
from ragstream_indexer.main import register_handlers

pytestmark = pytest.mark.integration


class RefusingIndexer(IndexService):
    """Refuses a document's first commit as a re-chunk switch would; notes every call."""

    def __init__(self, store: DocumentStore) -> None:
        super().__init__(store)
        self.calls: list[str] = []

    async def run(self, message: ChunksEmbedded) -> DocumentIndexed | None:
        if "refused" not in self.calls:
            self.calls.append("refused")
            raise StaleChunkingError(message.header.document_id, message.index_version, message.index_version + 1)
        self.calls.append("indexed")
        return await super().run(message)


class Collected:
    """A change sink that keeps what the fetch announced."""

    def __init__(self) -> None:
        self.changes: list[DocumentChanged] = []

    async def changed(self, message: DocumentChanged) -> None:
        self.changes.append(message)

    async def deleted(self, message: DocumentDeleted) -> None:
        raise AssertionError("nothing is deleted here")


async def test_the_indexer_runs_a_stale_document_again_at_once(runtime: Runtime, tmp_path: Path) -> None:
    (tmp_path / "avocet.md").write_text("# Avocet\n\nThe avocet sweeps its upturned bill through the mud.\n")
    connector = FolderConnector(tmp_path)
    fetch = FetchService(runtime.store, connector, max_document_bytes=runtime.settings.max_document_bytes)
    await fetch.register()
    collected = Collected()
    await fetch.run(collected)
    [batch] = await runtime.chunker.run(collected.changes[0])
    embedded = await runtime.embed.run(batch)
    indexer = RefusingIndexer(runtime.store)
    broker = create_broker("127.0.0.1:9", "indexer")  # never connected: the test broker stands in
    register_handlers(broker, consumer_options(runtime.settings, "indexer"))
    broker.context.set_global("service", ServiceContext("indexer", replace(runtime, indexer=indexer), broker))
    try:
        async with TestKafkaBroker(broker) as test_broker:
            await test_broker.publish(embedded, Topic.CHUNK_EMBEDDED.value, key=b"avocet")

        assert indexer.calls == ["refused", "indexed"]
        row = await runtime.pool.fetchrow(
            "SELECT status, chunk_count FROM documents WHERE connection_id = $1", connector.connection_id
        )
        assert row is not None and (row["status"], row["chunk_count"]) == ("indexed", 1)
        assert await runtime.store.failures(connector.connection_id) == []
    finally:
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connector.connection_id)
