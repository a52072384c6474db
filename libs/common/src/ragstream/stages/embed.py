"""Embed stage: one batch of chunks in, the same batch with packed float32 vectors out."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ragstream.contextual import ChunkContextualizer, EmbeddableChunk, TitledChunk
from ragstream.core.vectors import Vectors
from ragstream.embedding.base import Embedder
from ragstream.embedding.coalescing import CoalescingEmbedder, batch_limits
from ragstream.embedding.spaces import ActiveSpace, Space
from ragstream.logs import with_document_log_context
from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentChunked, DocumentHeader, pack_vectors

__all__ = ["EmbedService", "embedding_input", "embedding_inputs", "embedding_text"]


def embedding_text(header: DocumentHeader, chunk: ChunkPayload) -> str:
    """The title and heading path go in with the text: a chunk that says "run the installer" is only
    findable for "install on Linux" if the model sees the heading it sits under."""
    return embedding_input(header.title, chunk.heading, chunk.text)


def embedding_input(title: str, heading: str, text: str, context: str = "") -> str:
    """``embedding_text`` from stored columns: a re-index embeds exactly what ingest did. A contextual
    retrieval line, when there is one, goes first.

    A heading path that starts with the title (a page's own heading, or the title the chunker gives the
    text before the first heading) is the whole path: the title is not said twice."""
    if title and (heading == title or heading.startswith(f"{title} > ")):
        title = ""
    path = " > ".join(part for part in (title, heading) if part)
    body = f"{path}\n{text}" if path else text
    return f"{context}\n{body}" if context else body


async def embedding_inputs(chunks: Sequence[EmbeddableChunk], contextualizer: ChunkContextualizer | None) -> list[str]:
    """What each chunk is embedded from, with its contextual-retrieval line when that is on: the one
    rule ingest, re-chunk and re-index share."""
    contexts = await contextualizer.contexts(chunks) if contextualizer is not None else [""] * len(chunks)
    return [
        embedding_input(chunk.title, chunk.heading, chunk.text, context)
        for chunk, context in zip(chunks, contexts, strict=True)
    ]


class EmbedService:
    """Embeds one chunk batch with its connection's model.

    Concurrent ``run`` calls (the embedded pipeline's workers, a service's concurrent messages)
    share the provider's calls: each model's embedder is wrapped in a ``CoalescingEmbedder`` that
    packs the chunks of many documents into the provider's best batch size, while each batch still
    comes back on its own and is committed by its own document's transaction.

    An edited document is embedded again only where its text changed: with ``spaces``, a chunk whose
    embedding input is that of one of the document's committed chunks gets that chunk's vector from
    the model's table, and only the others go to the model (a batch with none left loads no model).
    Not with contextual retrieval, whose context line depends on the whole document.

    Usage:
        embedded = await EmbedService(embedder, spaces).run(chunked)   # -> ChunksEmbedded
    """

    def __init__(
        self,
        embedder: Embedder,
        spaces: ActiveSpace | None = None,
        contextualizer: ChunkContextualizer | None = None,
    ) -> None:
        """With ``spaces``, each batch is embedded by its connection's model (pinned, else the active
        space's; a re-index changes it); without, always by ``embedder``. With ``contextualizer``,
        each chunk is embedded with its contextual-retrieval line."""
        self._embedder = embedder
        self._spaces = spaces
        self._contextualizer = contextualizer
        self._coalescers: dict[str, CoalescingEmbedder] = {}

    def _shared(self, embedder: Embedder) -> Embedder:
        """``embedder`` behind the coalescer of its model, or as is when it declares no batch limits."""
        limits = batch_limits(embedder)
        if limits is None:
            return embedder
        coalescer = self._coalescers.get(embedder.model_key)
        if coalescer is None or coalescer.inner is not embedder:
            coalescer = self._coalescers[embedder.model_key] = CoalescingEmbedder(embedder, limits)
        return coalescer

    @with_document_log_context
    async def run(self, message: DocumentChunked) -> ChunksEmbedded:
        title = message.header.title
        chunks = [TitledChunk(title, chunk.heading, chunk.text) for chunk in message.chunks]
        inputs = await embedding_inputs(chunks, self._contextualizer)
        if self._spaces is None:
            embedder = self._embedder
            vectors = await self._shared(embedder).embed(inputs)
        else:
            space = await self._spaces.for_connection(message.header.connection_id)
            embedder = space.embedder
            vectors = await self._embed_changed(self._spaces, space, message, inputs)
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

    async def _embed_changed(
        self, spaces: ActiveSpace, space: Space, message: DocumentChunked, inputs: list[str]
    ) -> Vectors:
        """The vectors of ``inputs`` (those of ``message``'s chunks): the committed one of each input the
        document's chunks in ``space`` were embedded from, the model's for the rest."""
        known: dict[str, Vectors] = {}
        if self._contextualizer is None:
            texts = [chunk.text for chunk in message.chunks]
            for chunk, vector in await spaces.embedded_chunks(space, message.header.document_id, texts):
                known[embedding_input(chunk.title, chunk.heading, chunk.text)] = vector
        changed = list(dict.fromkeys(text for text in inputs if text not in known))
        if changed:
            known.update(zip(changed, await self._shared(space.embedder).embed(changed), strict=True))
        return np.vstack([known[text] for text in inputs]).astype(np.float32)

    async def warm_up(self, connection_id: str) -> None:
        """Load the model that embeds ``connection_id``'s chunks now, e.g. as its first changed document
        is announced: the load (seconds for the local model) then overlaps parsing and chunking."""
        embedder = (
            self._embedder if self._spaces is None else (await self._spaces.for_connection(connection_id)).embedder
        )
        await embedder.warm_up()

    def invalidate(self) -> None:
        """Read the connections' models again: a commit refused the model this process had cached."""
        if self._spaces is not None:
            self._spaces.invalidate()
