"""Token chunking: heading-aware chunks of at most N tokens of the embedding model's own tokenizer."""

from __future__ import annotations

import asyncio
import functools
import math
import re
from typing import Protocol, runtime_checkable

from ragstream.chunking.base import SizedSplitter, split_sections, to_payloads
from ragstream.messages import ChunkPayload
from ragstream.parsing import ParsedDocument

__all__ = ["EstimatedTokenizer", "HasTokenizer", "TokenChunker", "Tokenizer", "tokenizer_for"]

# Han, kana and hangul: one token per character or more in every tokenizer we know of.
_CJK = re.compile(r"[\u1100-\u11ff\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")


@runtime_checkable
class Tokenizer(Protocol):
    """Counts tokens the way an embedding model does; ``warm_up`` loads the vocabulary."""

    def warm_up(self) -> None: ...

    def count(self, text: str) -> int: ...


@runtime_checkable
class HasTokenizer(Protocol):
    """An embedder that knows its tokenizer (the local USE model); remote ones usually do not."""

    def tokenizer(self) -> Tokenizer: ...


class EstimatedTokenizer:
    """The fallback for models whose tokenizer is not available here (DashScope, OpenAI-compatible).

    A deliberate overestimate, so chunks stay under the limit: one token per CJK character and one
    per three other characters (BPE tokenizers average about four for English). Remote models
    accept 8k tokens, so a chunk of "512" estimated tokens is far from their window either way.
    """

    def warm_up(self) -> None:
        """Nothing to load."""

    def count(self, text: str) -> int:
        cjk = len(_CJK.findall(text))
        return cjk + math.ceil((len(text) - cjk) / 3)


def tokenizer_for(embedder: object) -> Tokenizer:
    """The embedder's own tokenizer when it exposes one, else the character-based estimate."""
    return embedder.tokenizer() if isinstance(embedder, HasTokenizer) else EstimatedTokenizer()


class TokenChunker:
    """Like ``MarkdownChunker`` (headings first, small sections merged, long ones split at
    paragraphs, then sentences) but ``size`` and ``overlap`` are tokens, so no chunk is longer than
    ``size`` tokens of the model that embeds it. Only the chunk text counts: the title and heading
    path the embed stage puts in front are not part of the budget.
    """

    def __init__(self, size: int = 512, overlap: int = 0, tokenizer: Tokenizer | None = None) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        if not 0 <= overlap < size:
            raise ValueError("overlap must be at least 0 and smaller than size")
        self.size = size
        self.overlap = overlap
        self.tokenizer = tokenizer or EstimatedTokenizer()
        # The splitter measures the same small parts again and again while it merges and pops them.
        self._splitter = SizedSplitter(size, overlap, functools.lru_cache(maxsize=4096)(self.tokenizer.count))

    def warm_up(self) -> None:
        self.tokenizer.warm_up()

    def run(self, document: ParsedDocument) -> list[ChunkPayload]:
        return to_payloads(self._splitter.chunk_sections(split_sections(document.markdown)), document.title)

    async def run_async(self, document: ParsedDocument) -> list[ChunkPayload]:
        # Counting tokens is pure Python: off the loop, so the API and Kafka heartbeats keep going.
        return await asyncio.to_thread(self.run, document)
