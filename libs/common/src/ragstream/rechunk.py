"""Re-chunk without downtime: rebuild one connection's chunks with a new chunking config, then switch.

Search keeps reading the connection's active index version while the next one is filled, document
by document, from the committed staged content, chunked with the new config and embedded in the
connection's embedding space. Ingest keeps committing with the old config meanwhile; an edited document
loses its new-version chunks and is rebuilt again from its new content. The switch
(``RechunkStore.switch``) rebuilds the last stragglers under the connection row's lock, makes the new
version active with its config and deletes the old chunks, in one transaction. A failure or a
cancellation leaves the old version active; run it again with the same config and the documents
already rebuilt are skipped. Migration 0010 has the design.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ragstream.chunking import Chunker, ChunkingConfig
from ragstream.contextual import ChunkContextualizer, TitledChunk
from ragstream.core.errors import DocumentError, RagstreamError
from ragstream.embedding.spaces import ActiveSpace
from ragstream.jobs.progress import RunProgress
from ragstream.stages.chunk import ChunkService
from ragstream.stages.embed import embedding_inputs
from ragstream.storage.rechunk import (
    RebuiltChunks,
    RechunkBusy,
    RechunkDocument,
    RechunkStore,
    UnknownConnection,
)

__all__ = ["RechunkBusy", "RechunkFailed", "RechunkProgress", "Rechunker", "UnknownConnection"]

logger = logging.getLogger(__name__)


class MissingContent(DocumentError):
    """The committed version's staged content is gone: only a sync can bring the document back."""


class RechunkFailed(RagstreamError):
    """Documents could not be rebuilt: the run fails and the active version stays."""


@dataclass(slots=True, kw_only=True)
class RechunkProgress(RunProgress):
    """A re-chunk's counts: documents of the connection, rebuilt, failed, and the new version's chunks."""

    documents_total: int = 0
    documents_done: int = 0
    documents_failed: int = 0
    chunks: int = 0
    # Rebuilt by this run (a resumed run's earlier documents do not count for its rate).
    rebuilt_here: int = 0
    # The first document that failed, and why.
    first_error: str | None = None

    @property
    def total(self) -> int:
        return self.documents_total

    @property
    def done(self) -> int:
        return self.documents_done

    @property
    def processed(self) -> int:
        return self.rebuilt_here

    def counts(self) -> dict[str, Any]:
        return {
            "documents_total": self.documents_total,
            "documents_done": self.documents_done,
            "documents_failed": self.documents_failed,
            "chunks": self.chunks,
        }


class Rechunker:
    """Runs a re-chunk of one connection, at most one per connection at a time (across processes:
    ``RechunkStore.exclusive``). ``batch_size`` documents are read per query. The run's row (a
    ``rechunk`` run, executed by the runner) gets its index version and config here; its progress
    is what ``on_progress`` is given."""

    def __init__(
        self,
        store: RechunkStore,
        chunking: ChunkService,
        spaces: ActiveSpace,
        *,
        batch_size: int = 16,
        contextualizer: ChunkContextualizer | None = None,
    ) -> None:
        self._store = store
        self._chunking = chunking
        self._spaces = spaces
        self._contextualizer = contextualizer
        self._batch = batch_size

    async def run(
        self,
        run_id: int,
        connection_id: str,
        config: ChunkingConfig,
        on_progress: Callable[[RechunkProgress], None] | None = None,
    ) -> RechunkProgress:
        """Re-chunk the connection with ``config`` as run ``run_id`` and switch to it. Raises why it
        could not (``RechunkBusy``, ``UnknownConnection``, ``RechunkFailed``, any error of the
        switch); the active version is then untouched, and a rerun with the same config resumes."""
        notify = on_progress or (lambda _: None)
        stored = config.model_dump(mode="json")
        async with self._store.exclusive(connection_id):
            index_version = await self._store.prepare(run_id, connection_id, stored)
            progress = RechunkProgress()
            await self._recount(connection_id, index_version, progress)
            notify(progress)
            chunker = await self._chunking.chunker(config)
            await self._backfill(connection_id, index_version, chunker, progress, notify)
            if progress.documents_failed:
                raise RechunkFailed(
                    f"{progress.documents_failed} of {progress.documents_total} documents could not be"
                    f" re-chunked; first {progress.first_error}"
                )
            space = await self._spaces.for_connection(connection_id)
            rebuilt = await self._store.switch(
                connection_id,
                index_version,
                stored,
                space.model_key,
                space.embedder.dimension,
                lambda document: self._rebuild(chunker, document),
                self._batch,
            )
            progress.rebuilt_here += rebuilt
            await self._recount(connection_id, index_version, progress)
            notify(progress)
        return progress

    async def _recount(self, connection_id: str, index_version: int, progress: RechunkProgress) -> None:
        """Counts from the database: documents added, edited or deleted meanwhile change them."""
        total, done, chunks = await self._store.counts(connection_id, index_version)
        progress.documents_total, progress.documents_done, progress.chunks = total, done, chunks

    async def _backfill(
        self,
        connection_id: str,
        index_version: int,
        chunker: Chunker,
        progress: RechunkProgress,
        notify: Callable[[RechunkProgress], None],
    ) -> None:
        """Passes over the documents lacking new-version chunks until one finds less than a batch
        (the rest, changed since, is left to the switch) or a document failed (the run fails; a
        rerun retries those documents only)."""
        while True:
            after, found = "", 0
            progress.documents_failed, progress.first_error = 0, None
            while documents := await self._store.pending(connection_id, index_version, after, self._batch):
                for document in documents:
                    after = document.document_id
                    found += 1
                    try:
                        rebuilt = await self._rebuild(chunker, document)
                    except Exception as error:  # one document's failure must not stop the others
                        progress.documents_failed += 1
                        progress.first_error = progress.first_error or f"{document.source}: {error}"
                        continue
                    if await self._store.store(document, index_version, rebuilt):
                        progress.rebuilt_here += 1
                        progress.documents_done += 1
                        progress.chunks += len(rebuilt.chunks)
                    notify(progress)
            await self._recount(connection_id, index_version, progress)
            notify(progress)
            if progress.documents_failed or found < self._batch:
                return

    async def _rebuild(self, chunker: Chunker, document: RechunkDocument) -> RebuiltChunks:
        content = await self._store.staged(document)
        if content is None:
            raise MissingContent(f"the content of version {document.version} is no longer staged; sync it again")
        title, chunks = await self._chunking.chunk(content, document.media_type, document.title, chunker)
        space = await self._spaces.for_connection(document.connection_id)
        titled = [TitledChunk(title, chunk.heading, chunk.text) for chunk in chunks]
        vectors = await space.embedder.embed(await embedding_inputs(titled, self._contextualizer))
        return RebuiltChunks(title, chunks, vectors, space.model_key)
