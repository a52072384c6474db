"""Chunk stage: staged bytes to heading-aware chunks, in batches small enough for one message each."""

from __future__ import annotations

from ragstream.chunking import MarkdownChunker
from ragstream.messages import DocumentChanged, DocumentChunked
from ragstream.parsing import ParseError, ParseErrorCode, Parser
from ragstream.storage.documents import DocumentStore

__all__ = ["ChunkService"]


class ChunkService:
    """Loads the staged content, parses and chunks it.

    Returns no batches when this version is already committed or superseded (a redelivery, or a
    replay that a newer change overtook): the work would be thrown away by the indexer anyway. Raises ``ParseError``
    for a document that can never be indexed as it is.
    """

    def __init__(self, store: DocumentStore, parser: Parser, chunker: MarkdownChunker, batch_chunks: int) -> None:
        self._store = store
        self._parser = parser
        self._chunker = chunker
        self._batch_chunks = batch_chunks

    async def run(self, message: DocumentChanged) -> list[DocumentChunked]:
        header = message.header
        if await self._store.is_superseded(header.document_id, header.version):
            return []
        content = await self._store.load_staged(header.version)
        if content is None:
            return []
        parsed = self._parser.run(content, header.media_type, header.title)
        chunks = self._chunker.run(parsed)
        if not chunks:
            raise ParseError(ParseErrorCode.EMPTY, "the document has no text to index")
        header = header.model_copy(update={"title": parsed.title})
        size = self._batch_chunks
        batches = [chunks[start : start + size] for start in range(0, len(chunks), size)]
        return [
            DocumentChunked(
                header=header, batch_index=index, batch_count=len(batches), chunk_count=len(chunks), chunks=batch
            )
            for index, batch in enumerate(batches)
        ]
