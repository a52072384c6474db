"""Markdown heading-aware chunking: sections first, then paragraphs, then sentences (CJK too)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from langchain_text_splitters import RecursiveCharacterTextSplitter

from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument

__all__ = ["MarkdownChunker"]

_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
# Paragraph, line, then sentence ends in English and Chinese, then clause breaks, then words.
_SEPARATORS = ["\n\n", "\n", "。", "！", "？", ". ", "! ", "? ", "；", "; ", "，", ", ", " ", ""]
_MAX_HEADING_CHARS = 300


@dataclass(frozen=True, slots=True)
class _Section:
    heading: str
    text: str


class MarkdownChunker:
    """Splits a Markdown document into chunks of about ``size`` characters that keep their headings.

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
        self._splitter = RecursiveCharacterTextSplitter(
            separators=_SEPARATORS, chunk_size=size, chunk_overlap=overlap, keep_separator="end"
        )

    def run(self, document: ParsedDocument) -> list[ChunkPayload]:
        pieces: list[_Section] = []
        for section in self._merge_small(self._split_sections(document.markdown)):
            if len(section.text) <= self.size:
                pieces.append(section)
            else:
                pieces.extend(_Section(section.heading, part) for part in self._split_long(section.text))
        return [
            ChunkPayload(ordinal=ordinal, heading=piece.heading, text=piece.text)
            for ordinal, piece in enumerate(p for p in pieces if p.text.strip())
        ]

    @staticmethod
    def _split_sections(markdown: str) -> list[_Section]:
        """Cut at heading lines outside code fences, tracking the path of enclosing headings."""
        sections: list[_Section] = []
        path: list[tuple[int, str]] = []
        lines: list[str] = []
        in_fence = False

        def flush() -> None:
            text = "\n".join(lines).strip()
            if text:
                heading = " > ".join(title for _, title in path)[:_MAX_HEADING_CHARS]
                sections.append(_Section(heading, text))
            lines.clear()

        for line in markdown.split("\n"):
            if _FENCE.match(line):
                in_fence = not in_fence
            heading = None if in_fence else _HEADING.match(line)
            if heading:
                flush()
                level = len(heading.group(1))
                path = [(lvl, title) for lvl, title in path if lvl < level]
                path.append((level, heading.group(2).strip()))
            lines.append(line)
        flush()
        return sections

    def _split_long(self, text: str) -> list[str]:
        """Split an oversized section; a heading line left alone is glued to the text after it."""
        parts: list[str] = []
        pending_heading = ""
        for part in self._splitter.split_text(text):
            if all(_HEADING.match(line) for line in part.strip().split("\n")):
                pending_heading = f"{pending_heading}{part.strip()}\n"
                continue
            parts.append(f"{pending_heading}{part}" if pending_heading else part)
            pending_heading = ""
        if pending_heading:
            parts.append(pending_heading.strip())
        return parts

    def _merge_small(self, sections: list[_Section]) -> list[_Section]:
        merged: list[_Section] = []
        for section in sections:
            if merged and len(merged[-1].text) + 2 + len(section.text) <= self.size:
                merged[-1] = _Section(merged[-1].heading, f"{merged[-1].text}\n\n{section.text}")
            else:
                merged.append(section)
        return merged
