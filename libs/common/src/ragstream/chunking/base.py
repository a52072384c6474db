"""What every chunker shares: Markdown sections with their heading paths, and a splitter that never exceeds its size."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument

__all__ = [
    "SEPARATORS",
    "Chunker",
    "Length",
    "Section",
    "SizedSplitter",
    "Span",
    "is_heading_only",
    "split_sections",
    "to_payloads",
]

_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
# Paragraph, line, then sentence ends in English and Chinese, then clause breaks, then words.
SEPARATORS = ["\n\n", "\n", "。", "！", "？", ". ", "! ", "? ", "；", "; ", "，", ", ", " ", ""]
_MAX_HEADING_CHARS = 300

Length = Callable[[str], int]
"""Measures a text in the chunker's unit: ``len`` for characters, a tokenizer's count for tokens."""


class Chunker(Protocol):
    """What the chunk stage needs: heavy setup once, then chunks of one parsed document.

    ``run_async`` is the common entry point because the semantic chunker awaits the embedder; the
    others also have a synchronous ``run`` and move it off the event loop.
    """

    def warm_up(self) -> None: ...

    async def run_async(self, document: ParsedDocument) -> list[ChunkPayload]: ...


@dataclass(frozen=True, slots=True)
class Section:
    """The text under one heading (heading line included) and where it starts in the Markdown."""

    heading: str
    text: str
    start: int = 0


@dataclass(frozen=True, slots=True)
class Span:
    """A piece of text and the offset it starts at in the text it was cut from."""

    start: int
    text: str


def is_heading_only(text: str) -> bool:
    return all(_HEADING.match(line) for line in text.strip().split("\n"))


def split_sections(markdown: str) -> list[Section]:
    """Cut at heading lines outside code fences, tracking the path of enclosing headings."""
    sections: list[Section] = []
    path: list[tuple[int, str]] = []
    lines: list[str] = []
    first = 0  # offset of lines[0] in the markdown
    offset = 0
    in_fence = False

    def flush() -> None:
        joined = "\n".join(lines)
        text = joined.strip()
        if text:
            heading = " > ".join(title for _, title in path)[:_MAX_HEADING_CHARS]
            sections.append(Section(heading, text, first + len(joined) - len(joined.lstrip())))
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
        if not lines:
            first = offset
        lines.append(line)
        offset += len(line) + 1
    flush()
    return sections


def to_payloads(pieces: Iterable[Section], title: str) -> list[ChunkPayload]:
    """The non-empty pieces as numbered chunks; text before the page's first heading gets the page's
    ``title`` as its heading, so the opening chunk (often the page's summary) says what it is about."""
    return [
        ChunkPayload(ordinal=ordinal, heading=piece.heading or title[:_MAX_HEADING_CHARS], text=piece.text)
        for ordinal, piece in enumerate(p for p in pieces if p.text.strip())
    ]


class SizedSplitter:
    """Recursive separators (paragraph, line, sentence, clause, word), measured by ``length``.

    The LangChain splitter picks the breaks and the overlap; its sizes are sums of the parts'
    lengths, which for tokens is not the length of the joined text, and a heading glued back onto
    the text after it adds to a part. So every piece is measured again and anything over ``size``
    is cut once more at the best break that fits: no piece this class returns measures more than
    ``size`` (for any ``size`` above the length of a single character).
    """

    def __init__(self, size: int, overlap: int, length: Length = len) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        if not 0 <= overlap < size:
            raise ValueError("overlap must be at least 0 and smaller than size")
        self.size = size
        self.overlap = overlap
        self.length = length
        # Imported here: LangChain takes a good share of a second to import, and a sync with nothing
        # to chunk (an unchanged re-sync, ``ragstream status``) must not pay for it.
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        self._splitter = RecursiveCharacterTextSplitter(
            separators=SEPARATORS,
            chunk_size=size,
            chunk_overlap=overlap,
            keep_separator="end",
            length_function=length,
        )

    def chunk_sections(self, sections: list[Section]) -> list[Section]:
        """Headings first: small neighbours merged, each section over the size split on its own."""
        pieces: list[Section] = []
        for section in self.merge_small(sections):
            if self.length(section.text) <= self.size:
                pieces.append(section)
            else:
                pieces.extend(Section(section.heading, span.text) for span in self.split(section.text))
        return pieces

    def merge_small(self, sections: list[Section]) -> list[Section]:
        """Merge neighbours up to the size so a page of one-line sections is not a pile of fragments.

        Sizes are added up (the joined text is not measured again: quadratic for tokens); a merge
        that comes out over the size is split again by ``chunk_sections``.
        """
        merged: list[tuple[Section, int]] = []
        separator = self.length("\n\n")
        for section in sections:
            size = self.length(section.text)
            if merged and merged[-1][1] + separator + size <= self.size:
                last, total = merged[-1]
                merged[-1] = (
                    Section(last.heading, f"{last.text}\n\n{section.text}", last.start),
                    total + separator + size,
                )
            else:
                merged.append((section, size))
        return [section for section, _ in merged]

    def split(self, text: str) -> list[Span]:
        """Split at the best breaks with overlap; a heading line left alone is glued to the text after it."""
        spans: list[Span] = []
        pending: Span | None = None
        cursor = 0
        for part in self._splitter.split_text(text):
            # Parts are stripped substrings in order, each starting after the previous one's start.
            start = text.find(part, cursor)
            start = cursor if start < 0 else start
            cursor = start + 1
            if is_heading_only(part):
                heading = f"{part.strip()}\n"
                pending = Span(pending.start, pending.text + heading) if pending else Span(start, heading)
                continue
            spans.extend(self._glue(pending, Span(start, part)) if pending else self.fit(Span(start, part)))
            pending = None
        if pending:
            spans.extend(self.fit(pending))
        return spans

    def _glue(self, heading: Span, part: Span) -> list[Span]:
        glued = heading.text + part.text.strip()
        if self.length(glued) <= self.size:
            return [Span(heading.start, glued)]
        # Too big together: the heading takes the first words of the part that fit after it.
        room = self.size - self.length(heading.text)
        if room < self.size // 4:
            return [*self.fit(heading), *self.fit(part)]
        body = part.text.strip()
        cut = self._cut(body, room)
        first = heading.text + body[:cut].rstrip()
        if self.length(first) > self.size:
            return [*self.fit(heading), *self.fit(part)]
        return [Span(heading.start, first), *self.fit(Span(part.start + cut, body[cut:]))]

    def fit(self, span: Span) -> list[Span]:
        """The stripped span if it fits, else consecutive pieces that do; no text is dropped.

        Meant for pieces near the size (it measures prefixes): long texts go through ``split``.
        """
        pieces: list[Span] = []
        start, text = span.start, span.text
        while True:
            stripped = text.lstrip()
            start += len(text) - len(stripped)
            text = stripped.rstrip()
            if not text:
                return pieces
            if self.length(text) <= self.size:
                pieces.append(Span(start, text))
                return pieces
            cut = self._cut(text, self.size)
            pieces.append(Span(start, text[:cut].rstrip()))
            start, text = start + cut, text[cut:]

    def _cut(self, text: str, budget: int) -> int:
        """Where to cut ``text`` so the head fits ``budget``: the best separator in the second half
        of the longest prefix that fits, else the end of that prefix (at least one character)."""
        low, high = 0, len(text)
        while low < high:  # the longest prefix that fits; a length grows (near enough) with the prefix
            middle = (low + high + 1) // 2
            if self.length(text[:middle]) <= budget:
                low = middle
            else:
                high = middle - 1
        if low == 0:
            return 1
        prefix = text[:low]
        for separator in SEPARATORS[:-1]:
            position = prefix.rfind(separator)
            if position > 0 and position + len(separator) >= low // 2:
                cut = position + len(separator)
                # A shorter prefix can, rarely, count one token more than a longer one.
                return cut if self.length(text[:cut].rstrip()) <= budget else low
        return low
