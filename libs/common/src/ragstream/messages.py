"""Payloads of every Kafka topic, defined once so producers and consumers import the same model.

Each topic is keyed by ``document_id`` so that all events of one document stay ordered on one
partition. Content travels by reference (a staging row) and chunks travel in bounded batches, so no
message comes near Kafka's 1 MB default; vectors travel as packed little-endian float32.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ragstream.core.vectors import Vectors

__all__ = [
    "SCHEMA_VERSION",
    "ChunkPayload",
    "ChunksEmbedded",
    "DeadLetter",
    "DocumentChanged",
    "DocumentChunked",
    "DocumentDeleted",
    "DocumentHeader",
    "DocumentIndexed",
    "IndexOutcome",
    "MessageOrigin",
    "Topic",
    "pack_vectors",
    "unpack_vectors",
]

SCHEMA_VERSION = 1


IndexVersion = Annotated[
    int,
    Field(
        title="Index version",
        description="The connection's index version whose chunking config made these chunks.",
        ge=0,
    ),
]


class Topic(StrEnum):
    """Topic names; ``doc.changed`` is log-compacted so a replay rebuilds every index."""

    DOC_CHANGED = "doc.changed"
    DOC_DELETED = "doc.deleted"
    DOC_CHUNKED = "doc.chunked"
    CHUNK_EMBEDDED = "chunk.embedded"
    INDEXED = "indexed"
    DEAD_LETTER = "doc.dead-letter"


class _Message(BaseModel):
    # bytes (packed vectors) travel as base64 inside the JSON body.
    model_config = ConfigDict(frozen=True, extra="ignore", ser_json_bytes="base64", val_json_bytes="base64")

    schema_version: Annotated[
        int, Field(title="Schema version", description="Bumped on incompatible payload changes.")
    ] = SCHEMA_VERSION


class DocumentHeader(BaseModel):
    """What every stage needs to know about a document, small enough to repeat in each message."""

    model_config = ConfigDict(frozen=True)

    document_id: Annotated[
        str, Field(title="Document id", description="Stable id: hash of connection and external id.")
    ]
    connection_id: Annotated[str, Field(title="Connection id")]
    external_id: Annotated[str, Field(title="Id at the origin", description="Relative path for a folder.")]
    version: Annotated[int, Field(title="Version", description="Monotonic; the indexer keeps only newer versions.")]
    content_hash: Annotated[str, Field(title="SHA-256 of the raw content")]
    title: Annotated[str, Field(title="Title")]
    source: Annotated[str, Field(title="Source", description="Relative path for a folder, else the URL.")]
    media_type: Annotated[str, Field(title="Media type", description="text/markdown, text/plain or text/html.")]
    source_version: Annotated[
        str | None, Field(title="Cheap version at the origin", description="mtime+size, revision, ...")
    ] = None
    knowledge_base: Annotated[str, Field(title="Knowledge base", description="Space, repo or folder name.")] = ""
    url: Annotated[str | None, Field(title="Link to the original", description="Shown on source cards.")] = None
    acl: Annotated[
        list[str] | None,
        Field(title="Allowed principals", description="'user:<id>' or 'group:<id>'; None: everyone."),
    ] = None
    metadata: Annotated[
        dict[str, str | int | float | bool], Field(title="Metadata", description="Filterable key/value pairs.")
    ] = {}


class DocumentChanged(_Message):
    """A new or changed document whose raw content is staged in PostgreSQL under ``version``."""

    kind: Literal["changed"] = "changed"
    header: DocumentHeader


class DocumentDeleted(_Message):
    """A document that disappeared at its origin; ``version`` orders it against earlier changes."""

    kind: Literal["deleted"] = "deleted"
    document_id: Annotated[str, Field(title="Document id")]
    connection_id: Annotated[str, Field(title="Connection id")]
    external_id: Annotated[str, Field(title="Id at the origin")]
    source: Annotated[str, Field(title="Source")]
    version: Annotated[int, Field(title="Version of the deletion")]


class ChunkPayload(BaseModel):
    """One chunk of text with the heading path it sits under."""

    model_config = ConfigDict(frozen=True)

    ordinal: Annotated[int, Field(title="Position in the document", ge=0)]
    heading: Annotated[str, Field(title="Heading path", description="e.g. 'Install > Linux'.")]
    text: Annotated[str, Field(title="Chunk text")]


class DocumentChunked(_Message):
    """One batch of a document's chunks; ``batch_count`` batches together make the document."""

    header: DocumentHeader
    batch_index: Annotated[int, Field(title="Batch index", ge=0)]
    batch_count: Annotated[int, Field(title="Number of batches", ge=1)]
    chunk_count: Annotated[int, Field(title="Chunks in the whole document", ge=1)]
    chunks: Annotated[list[ChunkPayload], Field(title="Chunks of this batch")]
    index_version: IndexVersion = 0


class ChunksEmbedded(_Message):
    """A batch of chunks with their vectors, packed as float32 in chunk order."""

    header: DocumentHeader
    batch_index: Annotated[int, Field(title="Batch index", ge=0)]
    batch_count: Annotated[int, Field(title="Number of batches", ge=1)]
    chunk_count: Annotated[int, Field(title="Chunks in the whole document", ge=1)]
    chunks: Annotated[list[ChunkPayload], Field(title="Chunks of this batch")]
    model_key: Annotated[str, Field(title="Embedding space", description="Model and dimension.")]
    dimension: Annotated[int, Field(title="Vector dimension", ge=1)]
    vectors: Annotated[bytes, Field(title="Packed vectors", description="little-endian float32, row-major")]
    index_version: IndexVersion = 0

    def vector_array(self) -> Vectors:
        return unpack_vectors(self.vectors, self.dimension)


class IndexOutcome(StrEnum):
    INDEXED = "indexed"
    DELETED = "deleted"
    STALE = "stale"


class DocumentIndexed(_Message):
    """Emitted once a document version (or its deletion) is committed, or found already superseded."""

    document_id: Annotated[str, Field(title="Document id")]
    connection_id: Annotated[str, Field(title="Connection id")]
    version: Annotated[int, Field(title="Version")]
    outcome: Annotated[IndexOutcome, Field(title="Outcome")]
    chunk_count: Annotated[int, Field(title="Chunks committed")] = 0


class MessageOrigin(BaseModel):
    """Where a consumed message that could not be decoded sat, and its bytes, so it can be found,
    inspected and published again once a consumer understands it."""

    model_config = ConfigDict(frozen=True, ser_json_bytes="base64", val_json_bytes="base64")

    topic: Annotated[str, Field(title="Topic")]
    partition: Annotated[int, Field(title="Partition", ge=0)]
    offset: Annotated[int, Field(title="Offset", ge=0)]
    key: Annotated[bytes | None, Field(title="Message key", description="Base64 in JSON; None: no key.")] = None
    payload: Annotated[
        bytes | None,
        Field(title="Message value", description="Base64 in JSON; None when too large to carry (see the offset)."),
    ] = None


class DeadLetter(_Message):
    """A document version that failed a stage for good, or a consumed message no stage could decode;
    replaying it re-drives the document."""

    header: Annotated[
        DocumentHeader | None,
        Field(title="Document", description="None for a message whose document could not be read."),
    ]
    step: Annotated[str, Field(title="Stage that failed", description="fetch, chunk, embed or index.")]
    code: Annotated[str, Field(title="Error code", description="e.g. binary, invalid_utf8, embedding_unavailable.")]
    message: Annotated[str, Field(title="Human-readable reason")]
    retryable: Annotated[bool, Field(title="Whether a later retry may succeed")]
    retry_count: Annotated[
        int,
        Field(
            title="Retries of this version so far",
            description="In-stage retries and replays made, before this failure was recorded for good.",
        ),
    ]
    origin: Annotated[
        MessageOrigin | None,
        Field(title="Undecodable message", description="Set when the consumed message itself was rejected."),
    ] = None


def pack_vectors(vectors: Vectors) -> bytes:
    return np.ascontiguousarray(vectors, dtype="<f4").tobytes()


def unpack_vectors(data: bytes, dimension: int) -> Vectors:
    if len(data) % (4 * dimension):
        raise ValueError(f"{len(data)} bytes do not split into float32 vectors of {dimension}")
    return np.frombuffer(data, dtype="<f4").reshape(-1, dimension).astype(np.float32)
