"""Markdown heading-aware chunking: sections first, then paragraphs, then sentences (CJK too)."""

from __future__ import annotations

import asyncio

from ragstream.chunking.base import SizedSplitter, split_sections, to_payloads
from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument

__all__ = ["MarkdownChunker"]


class MarkdownChunker:
    """Splits a Markdown document into chunks of at most ``size`` characters that keep their headings.

    Headings (``#`` to ``######``) are the preferred breaks. Neighbouring small sections are merged
    up to ``size`` so a page of one-line sections does not become a pile of fragments; a section
    larger than ``size`` is split at paragraph, then sentence breaks with ``overlap`` characters
    repeated so a sentence cut at a boundary is still whole in one chunk. Each chunk carries the
    heading path (``Guide > Install > Linux``) of the section it starts in.
    """

    def __init__(self, size: int = 1500, overlap: int = 100) -> None:
        if overlap >= size:
            raise ValueError("overlap must be smaller than size")
        self.size = size
        self.overlap = overlap
        self._splitter = SizedSplitter(size, overlap)

    def warm_up(self) -> None:
        """Nothing to load: characters need no tokenizer."""

    def run(self, document: ParsedDocument) -> list[ChunkPayload]:
        return to_payloads(self._splitter.chunk_sections(split_sections(document.markdown)), document.title)

    async def run_async(self, document: ParsedDocument) -> list[ChunkPayload]:
        return await asyncio.to_thread(self.run, document)
