"""Semantic chunking: embed sentences and start a new chunk where the meaning shifts."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from ragstream.chunking.base import (
    Section,
    SizedSplitter,
    Span,
    is_heading_only,
    split_sections,
    to_payloads,
)
from ragstream.chunking.token import EstimatedTokenizer, Tokenizer
from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument

if TYPE_CHECKING:
    from ragstream.embedding.base import Embedder, Vectors

__all__ = ["DEFAULT_AMOUNTS", "SemanticChunker", "ThresholdType", "breakpoints", "split_sentences"]

ThresholdType = Literal["percentile", "std", "iqr", "gradient"]

DEFAULT_AMOUNTS: dict[ThresholdType, float] = {"percentile": 95.0, "std": 3.0, "iqr": 1.5, "gradient": 95.0}
"""The usual defaults (LangChain's SemanticChunker): 95th percentile, 3 standard deviations, 1.5 IQR."""

# A sentence ends after . ! ? and whitespace (not after a list number like "3. "), right after 。！？；
# (Chinese needs no space), or at a blank line.
_SENTENCE_END = re.compile(r"(?<=[。！？；])\s*|(?<=[.!?])(?<!\b\d\.)(?<!\b\d\d\.)\s+|\n[ \t]*\n\s*")


def split_sentences(text: str) -> list[Span]:
    """Sentences with their offsets in ``text``; a heading line is kept with the sentence after it."""
    sentences: list[Span] = []
    position = 0
    pending: int | None = None  # where a run of heading lines waiting for their sentence starts
    for match in [*_SENTENCE_END.finditer(text), None]:
        end = match.start() if match else len(text)
        piece = text[position:end]
        start = position + len(piece) - len(piece.lstrip())
        piece = piece.strip()
        position = match.end() if match else len(text)
        if not piece:
            continue
        if pending is not None:
            start = pending
        if is_heading_only(piece) and match is not None:
            pending = start
            continue
        pending = None
        sentences.append(Span(start, text[start:end].strip()))
    return sentences


def breakpoints(distances: Sequence[float], threshold_type: ThresholdType, amount: float) -> list[int]:
    """Indices ``i`` where a new chunk starts after sentence ``i``: its distance to sentence ``i + 1``
    is above the threshold.

    - ``percentile``: above the ``amount``-th percentile of the distances;
    - ``std``: above the mean plus ``amount`` standard deviations;
    - ``iqr``: above the mean plus ``amount`` interquartile ranges;
    - ``gradient``: where the distance *rises* (from the previous one) more than the ``amount``-th
      percentile of the rises, which follows a drifting baseline in long texts. LangChain takes the
      central-difference gradient, which peaks one sentence before the shift; the rise does not.
    """
    values = np.asarray(distances, dtype=np.float64)
    if values.size == 0:
        return []
    scores = values
    if threshold_type == "percentile":
        threshold = float(np.percentile(values, amount))
    elif threshold_type == "std":
        threshold = float(values.mean() + amount * values.std())
    elif threshold_type == "iqr":
        q1, q3 = np.percentile(values, [25, 75])
        threshold = float(values.mean() + amount * (q3 - q1))
    else:
        scores = np.diff(values, prepend=values[0])
        threshold = float(np.percentile(scores, amount))
    return [int(index) for index in np.flatnonzero(scores > threshold)]


def _glue_lone_headings(sections: list[Section]) -> list[tuple[Section, str]]:
    """Sections with the heading path their first piece gets: a section that is only its heading
    line (a title right above a subtitle) goes in front of the next one instead of being a chunk of
    its own, and the first piece keeps the title's path, as in ``MarkdownChunker``."""
    glued: list[tuple[Section, str]] = []
    pending: Section | None = None
    for section in sections:
        lead = section.heading
        if pending is not None:
            lead = pending.heading
            section = Section(section.heading, f"{pending.text}\n\n{section.text}", pending.start)
            pending = None
        if is_heading_only(section.text):
            pending = Section(lead, section.text, section.start)
        else:
            glued.append((section, lead))
    if pending is not None:
        glued.append((pending, pending.heading))
    return glued


def _neighbour_distances(vectors: Vectors) -> list[float]:
    """Cosine distance of each sentence to the next one."""
    if len(vectors) < 2:
        return []
    norms = np.linalg.norm(vectors, axis=1)
    norms[norms == 0] = 1.0
    unit = vectors / norms[:, None]
    return [float(d) for d in 1.0 - np.einsum("ij,ij->i", unit[:-1], unit[1:])]


class SemanticChunker:
    """Splits each section into sentences (English and Chinese punctuation), embeds them with
    ``embedder``, and breaks where the distance between neighbours is above the threshold of the
    chosen ``threshold_type``, computed over all neighbour distances of the document.

    Headings are always breaks (a new heading is the clearest shift of meaning), and sections are
    not merged, except that a heading with no text of its own goes with the section after it. A
    piece longer than ``size`` tokens (``tokenizer``, the embedder's own when it has one) is split
    again at paragraph and sentence breaks, so no chunk exceeds ``size``.
    """

    def __init__(
        self,
        embedder: Embedder,
        threshold_type: ThresholdType = "percentile",
        threshold_amount: float | None = None,
        size: int = 512,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if threshold_type not in DEFAULT_AMOUNTS:
            raise ValueError(f"unknown threshold type {threshold_type!r}")
        amount = DEFAULT_AMOUNTS[threshold_type] if threshold_amount is None else threshold_amount
        if threshold_type in ("percentile", "gradient") and not 0 <= amount <= 100:
            raise ValueError("a percentile amount must be between 0 and 100")
        if amount < 0:
            raise ValueError("threshold_amount must not be negative")
        self.embedder = embedder
        self.threshold_type: ThresholdType = threshold_type
        self.threshold_amount = amount
        self.size = size
        self.tokenizer = tokenizer or EstimatedTokenizer()
        self._splitter = SizedSplitter(size, 0, functools.lru_cache(maxsize=4096)(self.tokenizer.count))

    def warm_up(self) -> None:
        # The embedder warms itself up on first use; it is shared with the embed stage.
        self.tokenizer.warm_up()

    async def run_async(self, document: ParsedDocument) -> list[ChunkPayload]:
        sections = _glue_lone_headings(split_sections(document.markdown))
        sentences = [split_sentences(section.text) for section, _ in sections]
        texts = [sentence.text for group in sentences for sentence in group]
        vectors = await self.embedder.embed(texts) if len(texts) > 1 else None
        return await asyncio.to_thread(self._assemble, sections, sentences, vectors, document.title)

    def _assemble(
        self,
        sections: list[tuple[Section, str]],
        sentences: list[list[Span]],
        vectors: Vectors | None,
        title: str,
    ) -> list[ChunkPayload]:
        # Distances only between neighbours in one section: a heading is a break anyway.
        distances: list[list[float]] = []
        first = 0
        for group in sentences:
            distances.append(_neighbour_distances(vectors[first : first + len(group)]) if vectors is not None else [])
            first += len(group)
        flat = [distance for group in distances for distance in group]
        cuts = set(breakpoints(flat, self.threshold_type, self.threshold_amount))
        pieces: list[Section] = []
        index = 0  # position of the section's first distance in ``flat``
        for (section, lead), group, group_distances in zip(sections, sentences, distances, strict=True):
            start = 0
            for i in range(len(group)):
                if i == len(group) - 1 or index + i in cuts:
                    pieces.extend(self._piece(section, lead, group[start], group[i]))
                    start = i + 1
            index += len(group_distances)
        return to_payloads(pieces, title)

    def _piece(self, section: Section, lead: str, first: Span, last: Span) -> list[Section]:
        """Sentences ``first`` to ``last`` of a section, split again if over the size; the piece
        that starts the section gets its ``lead`` heading path, the others the section's own."""
        text = section.text[first.start : last.start + len(last.text)].strip()
        spans = [Span(0, text)] if self._splitter.length(text) <= self.size else self._splitter.split(text)
        return [
            Section(lead if first.start == 0 and number == 0 else section.heading, span.text)
            for number, span in enumerate(spans)
        ]
