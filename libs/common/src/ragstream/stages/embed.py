"""Embed stage: one batch of chunks in, the same batch with packed float32 vectors out."""

from __future__ import annotations

from ragstream.embedding.base import Embedder
from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentChunked, DocumentHeader, pack_vectors

__all__ = ["EmbedService", "embedding_text"]


def embedding_text(header: DocumentHeader, chunk: ChunkPayload) -> str:
    """The title and heading path go in with the text: a chunk that says "run the installer" is only
    findable for "install on Linux" if the model sees the heading it sits under."""
    context = " > ".join(part for part in (header.title, chunk.heading) if part)
    return f"{context}\n{chunk.text}" if context else chunk.text


class EmbedService:
    def __init__(self, embedder: Embedder) -> None:
        self._embedder = embedder

    async def run(self, message: DocumentChunked) -> ChunksEmbedded:
        vectors = await self._embedder.embed([embedding_text(message.header, chunk) for chunk in message.chunks])
        return ChunksEmbedded(
            header=message.header,
            batch_index=message.batch_index,
            batch_count=message.batch_count,
            chunk_count=message.chunk_count,
            chunks=message.chunks,
            model_key=self._embedder.model_key,
            dimension=self._embedder.dimension,
            vectors=pack_vectors(vectors),
        )
