"""One document through chunk, embed and index in this process, and its re-run when a re-chunk or
re-index switch refused it as stale: the in-memory transport's worker, and the Kafka indexer's."""

from __future__ import annotations

from dataclasses import dataclass

from ragstream.messages import DocumentChanged, DocumentIndexed
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.documents import StaleChunkingError
from ragstream.storage.spaces import RetiredSpaceError

__all__ = ["STALE_ERRORS", "DocumentAttempt", "DocumentRun"]

STALE_ERRORS = (StaleChunkingError, RetiredSpaceError)
"""A commit refused because a switch replaced the chunker or the model the document was made with."""


@dataclass(slots=True)
class DocumentAttempt:
    """Where an attempt at a document is: the step a failure is recorded at, and its chunk count."""

    step: str = "chunk"
    chunk_count: int = 0


class DocumentRun:
    """Chunk, embed and commit one document with what is active now.

    Chunked just before a re-chunk switch and committed just after, a document is refused
    (``StaleChunkingError``); embedded just before a re-index switched its connection's model, it is
    refused too (``RetiredSpaceError``). ``rerun`` then runs it again at once, whole, with the config
    and the model now effective, rather than failing it until a replay or the next sync."""

    def __init__(self, chunker: ChunkService, embedder: EmbedService, indexer: IndexService) -> None:
        self._chunker = chunker
        self._embedder = embedder
        self._indexer = indexer

    async def run(self, message: DocumentChanged, attempt: DocumentAttempt) -> list[DocumentIndexed]:
        attempt.step, attempt.chunk_count = "chunk", 0
        batches = await self._chunker.run(message)
        attempt.chunk_count = sum(len(batch.chunks) for batch in batches)
        committed = []
        for batch in batches:
            attempt.step = "embed"
            embedded = await self._embedder.run(batch)
            attempt.step = "index"
            if (indexed := await self._indexer.run(embedded)) is not None:
                committed.append(indexed)
        return committed

    async def rerun(
        self, message: DocumentChanged, refused: BaseException, attempt: DocumentAttempt
    ) -> list[DocumentIndexed]:
        """``run`` once more after ``refused`` (one of ``STALE_ERRORS``)."""
        if isinstance(refused, RetiredSpaceError):
            self._embedder.invalidate()  # the model this process had cached is retired
        return await self.run(message, attempt)
