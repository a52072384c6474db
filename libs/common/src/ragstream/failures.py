"""One classification of stage errors, so both wirings record the same codes and retry the same way.

Hierarchy of what a stage may raise::

    ParseError        permanent: the document itself is unreadable (empty, binary, bad UTF-8, ...)
    EmbeddingError    retryable or not, as the provider said (throttling vs. a rejected input)
    Exception         anything else: recorded as retryable, the next sync tries again
"""

from __future__ import annotations

from dataclasses import dataclass

from ragstream.embedding.base import EmbeddingError
from ragstream.messages import DocumentHeader
from ragstream.metrics import DOCUMENTS_FAILED
from ragstream.parsing import ParseError
from ragstream.storage.documents import DocumentStore, Failure

__all__ = ["StageFailure", "classify", "record_failure"]


@dataclass(frozen=True, slots=True)
class StageFailure:
    code: str
    message: str
    retryable: bool


def classify(error: Exception) -> StageFailure:
    if isinstance(error, ParseError):
        return StageFailure(error.code, error.message, retryable=False)
    if isinstance(error, EmbeddingError):
        return StageFailure("embedding_failed", str(error), retryable=error.retryable)
    return StageFailure(type(error).__name__, str(error) or repr(error), retryable=True)


async def record_failure(store: DocumentStore, header: DocumentHeader, step: str, failure: StageFailure) -> Failure:
    """Persist the failure as a row (the source of truth for reports) and count it in the metrics."""
    DOCUMENTS_FAILED.labels(step, failure.code).inc()
    return await store.record_failure(
        header, step=step, code=failure.code, message=failure.message, retryable=failure.retryable
    )
