"""Index stage: commit a document's chunks and vectors once all its batches are in, or its deletion."""

from __future__ import annotations

import numpy as np

from ragstream.core.errors import DocumentError
from ragstream.logs import log_context, with_document_log_context
from ragstream.messages import ChunksEmbedded, DocumentDeleted, DocumentIndexed, IndexOutcome
from ragstream.metrics import CHUNKS_INDEXED, DOCUMENTS_INDEXED
from ragstream.storage.documents import DocumentStore

__all__ = ["IndexService", "MixedEmbeddingModelsError"]


class MixedEmbeddingModelsError(DocumentError):
    """The batches of one document version were embedded by different models."""


class IndexService:
    """Idempotent by version: the store ignores anything not newer than what it has committed."""

    def __init__(self, store: DocumentStore) -> None:
        self._store = store

    @with_document_log_context
    async def run(self, message: ChunksEmbedded) -> DocumentIndexed | None:
        """Commit when this batch completes its document; None while batches are still missing."""
        batches = [message] if message.batch_count == 1 else await self._store.add_pending_batch(message)
        if batches is None:
            return None
        header = batches[0].header
        models = {batch.model_key for batch in batches}
        if len(models) > 1:
            # A re-index switched models between this document's batches: its vectors are not of one
            # space. Recorded as a retryable failure; the replay re-embeds all of it with one model.
            raise MixedEmbeddingModelsError(f"batches of {header.document_id} come from {sorted(models)}")
        chunks = [chunk for batch in batches for chunk in batch.chunks]
        vectors = np.vstack([batch.vector_array() for batch in batches])
        outcome = await self._store.commit_document(header, chunks, vectors, message.model_key, message.index_version)
        DOCUMENTS_INDEXED.labels(outcome.value).inc()
        if outcome is IndexOutcome.INDEXED:
            CHUNKS_INDEXED.inc(len(chunks))
        return DocumentIndexed(
            document_id=header.document_id,
            connection_id=header.connection_id,
            version=header.version,
            outcome=outcome,
            chunk_count=len(chunks) if outcome is IndexOutcome.INDEXED else 0,
        )

    async def delete(self, message: DocumentDeleted) -> DocumentIndexed:
        with log_context(connection_id=message.connection_id, document_id=message.document_id):
            outcome = await self._store.delete_document(message)
        DOCUMENTS_INDEXED.labels(outcome.value).inc()
        return DocumentIndexed(
            document_id=message.document_id,
            connection_id=message.connection_id,
            version=message.version,
            outcome=outcome,
        )
