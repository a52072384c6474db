"""Topic payloads: versioned, round-trip through JSON, and far below Kafka's 1 MB message limit."""

from __future__ import annotations

import numpy as np
import pytest

from ragstream.messages import (
    SCHEMA_VERSION,
    ChunkPayload,
    ChunksEmbedded,
    DocumentHeader,
    pack_vectors,
    unpack_vectors,
)
from ragstream.settings import ChunkingSettings

HEADER = DocumentHeader(
    document_id="d" * 32,
    connection_id="folder-0123456789abcdef",
    external_id="deep/path/" * 20 + "doc.md",
    version=2**40,
    content_hash="f" * 64,
    title="标题" * 100,
    source="deep/path/" * 20 + "doc.md",
    media_type="text/markdown",
    source_version="1700000000000000000:123456",
)


def worst_case_batch(dimension: int) -> ChunksEmbedded:
    """A full batch of maximum-size chunks in a 3-byte-per-character script with the largest vectors."""
    batch = ChunkingSettings().batch_chunks
    size = ChunkingSettings().size + 300
    chunks = [ChunkPayload(ordinal=i, heading="章节" * 150, text="汉" * size) for i in range(batch)]
    vectors = np.random.default_rng(0).standard_normal((batch, dimension)).astype(np.float32)
    return ChunksEmbedded(
        header=HEADER,
        batch_index=0,
        batch_count=1,
        chunk_count=batch,
        chunks=chunks,
        model_key="dashscope-text-embedding-v3-1024",
        dimension=dimension,
        vectors=pack_vectors(vectors),
    )


@pytest.mark.parametrize("dimension", [512, 1024])
def test_the_largest_message_stays_far_below_one_megabyte(dimension: int) -> None:
    assert len(worst_case_batch(dimension).model_dump_json().encode()) < 512 * 1024


def test_vectors_round_trip_as_packed_float32() -> None:
    message = worst_case_batch(1024)
    restored = ChunksEmbedded.model_validate_json(message.model_dump_json())
    assert restored == message
    assert restored.schema_version == SCHEMA_VERSION
    assert np.array_equal(restored.vector_array(), unpack_vectors(message.vectors, 1024))
    assert restored.vector_array().dtype == np.float32


def test_a_truncated_vector_payload_is_rejected() -> None:
    with pytest.raises(ValueError, match="do not split"):
        unpack_vectors(b"\x00" * 10, 4)
