"""Contextual retrieval: a chat model writes one line placing each chunk in its document, and that
line goes before the chunk in the text the embedder sees (never in the stored or returned text).

A chunk that says "it is restarted nightly" becomes findable for "when is the billing service
restarted" once its line says which service the page is about. Each line is cached by a digest of
the model, title, heading path and text (``chunk_contexts``), so re-syncing, re-chunking or
re-indexing an unchanged chunk never asks the model again; the context of an unchanged chunk is kept
when other parts of its document change. A chat failure fails the document (``context_unavailable``,
retryable): embedding it without its context would silently mix two kinds of vectors.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ragstream.chat import ChatClient, ChatError
from ragstream.core.errors import ProviderError
from ragstream.storage.chunk_contexts import ChunkContextStore

__all__ = ["CONTEXT_PROMPT", "ChunkContextualizer", "ContextUnavailable", "EmbeddableChunk", "TitledChunk"]

CONTEXT_PROMPT = (
    "<document>\n{document}\n</document>\n"
    "Here is a chunk of that document:\n<chunk>\n{chunk}\n</chunk>\n"
    "Write one short sentence that situates this chunk within the whole document (what the document is "
    "and which part of it this is), to improve search retrieval of the chunk. Use the document's "
    "language. Answer with that sentence only."
)
#: One sentence; a longer answer is cut so that it never crowds the chunk out of the embedder's window.
MAX_CONTEXT_CHARS = 400


class EmbeddableChunk(Protocol):
    """What a chunk is embedded from: its document's title, its heading path and its text."""

    @property
    def title(self) -> str: ...

    @property
    def heading(self) -> str: ...

    @property
    def text(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TitledChunk:
    """A chunk of a message with its document's title: an ``EmbeddableChunk``."""

    title: str
    heading: str
    text: str


class ContextUnavailable(ProviderError):
    """The chat model could not write a chunk's context; the document fails and is tried again."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class ChunkContextualizer:
    """Usage:
    contexts = await ChunkContextualizer(chat, ChunkContextStore(pool)).contexts(chunks)
    # one line per chunk, from the cache or written now
    """

    def __init__(self, chat: ChatClient, cache: ChunkContextStore, *, document_chars: int = 8000) -> None:
        self._chat = chat
        self._cache = cache
        self._document_chars = document_chars

    async def contexts(self, chunks: Sequence[EmbeddableChunk]) -> list[str]:
        """Each chunk's context line, in order. The chunks of one title are its document as far as the
        model is told (a batch of a document's chunks, in order)."""
        digests = [self._digest(chunk) for chunk in chunks]
        known = await self._cache.get_many(list(dict.fromkeys(digests)))
        missing = {digest: chunk for digest, chunk in zip(digests, chunks, strict=True) if digest not in known}
        if missing:
            documents = {chunk.title: self._document(chunk.title, chunks) for chunk in missing.values()}
            written = await asyncio.gather(*(self._write(documents[chunk.title], chunk) for chunk in missing.values()))
            fresh = dict(zip(missing, written, strict=True))
            await self._cache.put_many(fresh)
            known |= fresh
        return [known[digest] for digest in digests]

    async def aclose(self) -> None:
        await self._chat.aclose()

    def _digest(self, chunk: EmbeddableChunk) -> bytes:
        parts = (self._chat.model, chunk.title, chunk.heading, chunk.text)
        return hashlib.sha256("\x00".join(parts).encode()).digest()

    def _document(self, title: str, chunks: Sequence[EmbeddableChunk]) -> str:
        text = "\n\n".join(chunk.text for chunk in chunks if chunk.title == title)
        return f"# {title}\n\n{text}"[: self._document_chars]

    async def _write(self, document: str, chunk: EmbeddableChunk) -> str:
        shown = f"{chunk.heading}\n{chunk.text}" if chunk.heading else chunk.text
        prompt = CONTEXT_PROMPT.format(document=document, chunk=shown)
        try:
            answer = await self._chat.complete([{"role": "user", "content": prompt}], max_tokens=120)
        except ChatError as error:
            raise ContextUnavailable(f"contextual retrieval: {error}", retryable=error.retryable) from None
        line = " ".join(answer.content.split())[:MAX_CONTEXT_CHARS]
        if not line:
            raise ContextUnavailable("contextual retrieval: the chat model wrote no context", retryable=True)
        return line
