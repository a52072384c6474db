"""The indexer's multi-batch assembly under redelivery, against a real PostgreSQL.

Kafka delivers at least once: an indexer that dies after committing a document but before committing
its offset gets the document's last batch again, and a sync re-announcing a document still in flight
lets batches of the older version arrive after the newer one is committed. Neither may leave rows in
``pending_batches`` (found by tests/e2e/test_fault_injection.py: a parked batch of an already
committed version never completes, so it stayed there for good) nor change the committed chunks.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentHeader, IndexOutcome, pack_vectors
from ragstream.runtime import Runtime
from ragstream.storage.documents import document_id

pytestmark = pytest.mark.integration

DIMENSION = 8


async def header(runtime: Runtime, connection_id: str, name: str) -> DocumentHeader:
    return DocumentHeader(
        document_id=document_id(connection_id, name),
        connection_id=connection_id,
        external_id=name,
        version=await runtime.store.next_version(),
        content_hash="0" * 64,
        title=name,
        source=name,
        media_type="text/markdown",
    )


def batches(header: DocumentHeader, texts: list[str]) -> list[ChunksEmbedded]:
    """One chunk per batch, as the chunker sends them with ``batch_chunks=1``."""
    vectors = np.random.default_rng(header.version).standard_normal((len(texts), DIMENSION)).astype(np.float32)
    return [
        ChunksEmbedded(
            header=header,
            batch_index=ordinal,
            batch_count=len(texts),
            chunk_count=len(texts),
            chunks=[ChunkPayload(ordinal=ordinal, heading="", text=text)],
            model_key=f"test-redelivery-{DIMENSION}",
            dimension=DIMENSION,
            vectors=pack_vectors(vectors[ordinal : ordinal + 1]),
        )
        for ordinal, text in enumerate(texts)
    ]


async def state(runtime: Runtime, doc: str) -> tuple[int, list[str]]:
    pending = await runtime.pool.fetchval("SELECT count(*) FROM pending_batches WHERE document_id = $1", doc)
    texts = await runtime.pool.fetch("SELECT text FROM chunks WHERE document_id = $1 ORDER BY ordinal", doc)
    return int(pending), [row["text"] for row in texts]


async def test_redelivered_and_superseded_batches_leave_nothing_pending(runtime: Runtime) -> None:
    connection_id = f"test-{uuid.uuid4().hex[:12]}"
    await runtime.store.ensure_connection(connection_id, "folder", "redelivery")
    first = await header(runtime, connection_id, "doc.md")
    old = batches(first, ["old zero", "old one"])
    second = first.model_copy(update={"version": await runtime.store.next_version()})
    new = batches(second, ["new zero", "new one", "new two"])

    assert await runtime.indexer.run(old[0]) is None  # parked until the last batch arrives
    committed = await runtime.indexer.run(old[1])
    assert committed is not None and committed.outcome is IndexOutcome.INDEXED
    assert await state(runtime, first.document_id) == (0, ["old zero", "old one"])

    # The indexer died before committing the offset of the last batch: it comes again.
    await runtime.indexer.run(old[1])
    assert await state(runtime, first.document_id) == (0, ["old zero", "old one"])

    # A newer version commits, then batches of the older one straggle in (a re-sync raced it).
    for batch in new:
        await runtime.indexer.run(batch)
    assert await state(runtime, first.document_id) == (0, ["new zero", "new one", "new two"])
    for batch in old:
        await runtime.indexer.run(batch)
    assert await state(runtime, first.document_id) == (0, ["new zero", "new one", "new two"])
