"""Chunk stage: staged bytes to heading-aware chunks, in batches small enough for one message each."""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from ragstream.chunking import Chunker, ChunkingConfig, create_chunker, parse_chunking
from ragstream.embedding.base import Embedder
from ragstream.logs import with_document_log_context
from ragstream.messages import ChunkPayload, DocumentChanged, DocumentChunked
from ragstream.parsing import ParseError, ParseErrorCode
from ragstream.parsing_pool import ParserPool
from ragstream.storage.documents import DocumentStore

__all__ = ["ChunkService"]


class ChunkService:
    """Loads the staged content, parses and chunks it with the chunker of the document's connection.

    The chunker comes from the connection's stored config (``connections.config["chunking"]``) and
    falls back to ``default`` (from settings). It is read for each document, so a changed choice
    applies to documents chunked from then on; documents already indexed keep their chunks until
    they change or a re-chunk run rebuilds them. Batches carry the connection's index version read
    with the config, so the indexer can refuse chunks of a config a re-chunk switch has replaced.
    One chunker is built and warmed up per distinct config and kept. Parsing runs in the pool's
    worker processes, each document within the time and memory budget of the settings.

    Returns no batches when this version is already committed or superseded (a redelivery, or a
    replay that a newer change overtook): the work would be thrown away by the indexer anyway. Raises ``ParseError``
    for a document that can never be indexed as it is.
    """

    def __init__(
        self, store: DocumentStore, parser: ParserPool, embedder: Embedder, default: ChunkingConfig, batch_chunks: int
    ) -> None:
        self._store = store
        self._parser = parser
        self._embedder = embedder
        self._default = default
        self._batch_chunks = batch_chunks
        self._chunkers: dict[ChunkingConfig, Chunker] = {}
        self._building = asyncio.Lock()

    async def config_for(self, connection_id: str) -> tuple[ChunkingConfig, int]:
        """The connection's chunking config (its own, else the default) and the index version its
        chunks belong to."""
        stored, index_version = await self._store.chunking_of(connection_id)
        try:
            return (self._default if stored is None else parse_chunking(stored)), index_version
        except ValidationError as error:
            raise ValueError(f"connection {connection_id} has an invalid chunking config: {error}") from error

    async def chunker_for(self, connection_id: str) -> tuple[Chunker, int]:
        """The connection's chunker and the index version its chunks belong to."""
        config, index_version = await self.config_for(connection_id)
        return await self.chunker(config), index_version

    async def chunker(self, config: ChunkingConfig) -> Chunker:
        """The warmed-up chunker of ``config``, built once per distinct config."""
        if (chunker := self._chunkers.get(config)) is None:
            async with self._building:  # two workers seeing a new config warm it up once
                if (chunker := self._chunkers.get(config)) is None:
                    chunker = create_chunker(config, self._embedder)
                    await asyncio.to_thread(chunker.warm_up)  # loading a tokenizer takes seconds
                    self._chunkers[config] = chunker
        return chunker

    async def chunk(
        self, content: bytes, media_type: str, title: str, chunker: Chunker
    ) -> tuple[str, list[ChunkPayload]]:
        """Parse and chunk one document's content: its parsed title and its chunks (never none)."""
        parsed = await self._parser.run(content, media_type, title)  # in a worker process, with its budget
        chunks = await chunker.run_async(parsed)
        if not chunks:
            raise ParseError(ParseErrorCode.EMPTY, "the document has no text to index")
        return parsed.title, chunks

    @with_document_log_context
    async def run(self, message: DocumentChanged) -> list[DocumentChunked]:
        header = message.header
        if await self._store.is_superseded(header.document_id, header.version):
            return []
        content = await self._store.load_staged(header.version)
        if content is None:
            return []
        chunker, index_version = await self.chunker_for(header.connection_id)
        title, chunks = await self.chunk(content, header.media_type, header.title, chunker)
        header = header.model_copy(update={"title": title})
        size = self._batch_chunks
        batches = [chunks[start : start + size] for start in range(0, len(chunks), size)]
        return [
            DocumentChunked(
                header=header,
                batch_index=index,
                batch_count=len(batches),
                chunk_count=len(chunks),
                chunks=batch,
                index_version=index_version,
            )
            for index, batch in enumerate(batches)
        ]
