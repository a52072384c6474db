"""Embed stage: one batch of chunks in, the same batch with packed float32 vectors out."""

from __future__ import annotations

from ragstream.embedding.base import Embedder
from ragstream.embedding.spaces import ActiveSpace
from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentChunked, DocumentHeader, pack_vectors

__all__ = ["EmbedService", "embedding_input", "embedding_text"]


def embedding_text(header: DocumentHeader, chunk: ChunkPayload) -> str:
    """The title and heading path go in with the text: a chunk that says "run the installer" is only
    findable for "install on Linux" if the model sees the heading it sits under."""
    return embedding_input(header.title, chunk.heading, chunk.text)


def embedding_input(title: str, heading: str, text: str) -> str:
    """``embedding_text`` from stored columns: a re-index embeds exactly what ingest did.

    A heading path that starts with the title (a page's own heading, or the title the chunker gives the
    text before the first heading) is the whole context: the title is not said twice."""
    if title and (heading == title or heading.startswith(f"{title} > ")):
        title = ""
    context = " > ".join(part for part in (title, heading) if part)
    return f"{context}\n{text}" if context else text


class EmbedService:
    def __init__(self, embedder: Embedder, spaces: ActiveSpace | None = None) -> None:
        """With ``spaces``, each batch is embedded by its connection's model (pinned, else the active
        space's; a re-index changes it); without, always by ``embedder``."""
        self._embedder = embedder
        self._spaces = spaces

    async def run(self, message: DocumentChunked) -> ChunksEmbedded:
        if self._spaces is None:
            embedder = self._embedder
        else:
            embedder = (await self._spaces.for_connection(message.header.connection_id)).embedder
        vectors = await embedder.embed([embedding_text(message.header, chunk) for chunk in message.chunks])
        return ChunksEmbedded(
            header=message.header,
            batch_index=message.batch_index,
            batch_count=message.batch_count,
            chunk_count=message.chunk_count,
            chunks=message.chunks,
            index_version=message.index_version,
            model_key=embedder.model_key,
            dimension=embedder.dimension,
            vectors=pack_vectors(vectors),
        )

    def invalidate(self) -> None:
        """Read the connections' models again: a commit refused the model this process had cached."""
        if self._spaces is not None:
            self._spaces.invalidate()
