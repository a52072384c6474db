"""Recursive character chunking: size first, across headings; headings only name the chunks."""

from __future__ import annotations

import asyncio
import bisect

from ragstream.chunking.base import Section, SizedSplitter, split_sections, to_payloads
from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument

__all__ = ["RecursiveChunker"]


class RecursiveChunker:
    """Cuts the whole document into chunks of at most ``size`` characters, preferring paragraph,
    then line, sentence, clause and word breaks, with ``overlap`` characters repeated.

    Unlike ``MarkdownChunker``, a heading is not a preferred break: chunks come out evenly full and
    may run on into the next section. Each chunk still carries the heading path of the section it
    starts in, and a heading line left at the end of a piece moves to the start of the next one.
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
        sections = split_sections(document.markdown)
        starts = [section.start for section in sections]

        def heading_at(offset: int) -> str:
            index = bisect.bisect_right(starts, offset) - 1
            return sections[index].heading if index >= 0 else ""

        spans = self._splitter.split(document.markdown)
        return to_payloads((Section(heading_at(span.start), span.text, span.start) for span in spans), document.title)

    async def run_async(self, document: ParsedDocument) -> list[ChunkPayload]:
        return await asyncio.to_thread(self.run, document)
