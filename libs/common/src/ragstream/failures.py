"""One classification of stage errors, so both wirings record the same codes and retry the same way.

Hierarchy of what a stage may raise::

    ParseError        permanent: the document itself is unreadable (empty, binary, bad UTF-8, over
                      the parse budget: ``parse_timeout``, ``parse_memory``, ...)
    EmbeddingError    transient (throttling, provider down: ``embedding_unavailable``) or permanent
                      (a rejected input: ``embedding_rejected``), as the provider said
    ContextUnavailable  the chat model of contextual retrieval failed (``context_unavailable``),
                      transient or permanent as the provider said
    TimeoutError,     transient: the cause is outside the document and passes
    ConnectionError
    CharacterNotInRepertoireError,  permanent (``unstorable_text``): text PostgreSQL refuses (a
    UntranslatableCharacterError,   NUL, a lone surrogate, a character without a form in the
    UnicodeEncodeError              database's encoding) that got past the parser
    PostgresError     anything else from the database: ``database_error``, recorded as retryable
    Exception         anything else: recorded as retryable (a replay or the next sync tries again),
                      but not retried at once: waiting does not fix a bug or a bad config

A transient failure is retried within the stage (``StageRetry``), each retry counted on the
document's failure row; after the last attempt the document is recorded failed (and, in the Kafka
services, dead-lettered) like any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import asyncpg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from ragstream.contextual import ContextUnavailable
from ragstream.core.errors import ProviderError
from ragstream.embedding.base import EmbeddingError
from ragstream.messages import DocumentHeader
from ragstream.metrics import DOCUMENTS_FAILED, DOCUMENTS_RETRIED
from ragstream.parsing import ParseError
from ragstream.storage.documents import DocumentStore, Failure

__all__ = ["StageFailure", "StageRetry", "classify", "is_transient", "record_failure", "record_retry"]

_T = TypeVar("_T")
_UNSTORABLE_TEXT = (asyncpg.CharacterNotInRepertoireError, asyncpg.UntranslatableCharacterError, UnicodeEncodeError)


@dataclass(frozen=True, slots=True)
class StageFailure:
    code: str
    message: str
    retryable: bool


def classify(error: Exception) -> StageFailure:
    if isinstance(error, ParseError):
        return StageFailure(error.code, error.message, retryable=False)
    if isinstance(error, ContextUnavailable):
        return StageFailure("context_unavailable", str(error), retryable=error.retryable)
    if isinstance(error, EmbeddingError):
        code = "embedding_unavailable" if error.retryable else "embedding_rejected"
        return StageFailure(code, str(error), retryable=error.retryable)
    if isinstance(error, _UNSTORABLE_TEXT):
        # The same text fails the same way on every attempt.
        return StageFailure("unstorable_text", f"PostgreSQL cannot store the document's text: {error}", retryable=False)
    if isinstance(error, asyncpg.PostgresError):
        return StageFailure("database_error", f"{type(error).__name__}: {error}", retryable=True)
    return StageFailure(type(error).__name__, str(error) or repr(error), retryable=True)


def is_transient(error: BaseException) -> bool:
    """Worth another attempt in a moment: the provider (as it said) or the network, not the document."""
    if isinstance(error, ProviderError):
        return error.retryable
    return isinstance(error, TimeoutError | ConnectionError)


@dataclass(frozen=True, slots=True)
class StageRetry:
    """Attempts per document and the exponential backoff between them (with jitter, so workers
    throttled together do not come back in lockstep). ``attempts=1`` never retries."""

    attempts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("a stage makes at least one attempt")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff times must not be negative")

    async def run(
        self,
        work: Callable[[], Awaitable[_T]],
        on_retry: Callable[[Exception], Awaitable[None]],
        transient: Callable[[BaseException], bool] = is_transient,
    ) -> _T:
        """``work()`` until it succeeds, fails for good, or the attempts run out; the last error is
        raised. ``on_retry`` sees each transient error before the wait (to count the retry)."""

        async def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            if isinstance(error, Exception):
                await on_retry(error)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=self.backoff_s, max=self.backoff_max_s, jitter=self.backoff_s),
            retry=retry_if_exception(transient),
            before_sleep=before_sleep,
            reraise=True,
        )

        async def attempt() -> _T:
            # A coroutine function of its own: tenacity awaits only what it sees as one, and ``work``
            # is often a lambda returning an awaitable.
            return await work()

        result: _T = await retrying(attempt)
        return result


async def record_failure(store: DocumentStore, header: DocumentHeader, step: str, failure: StageFailure) -> Failure:
    """Persist the failure as a row (the source of truth for reports) and count it in the metrics."""
    DOCUMENTS_FAILED.labels(step, failure.code).inc()
    return await store.record_failure(
        header, step=step, code=failure.code, message=failure.message, retryable=failure.retryable
    )


async def record_retry(store: DocumentStore, header: DocumentHeader, step: str, error: Exception) -> Failure:
    """A transient failure about to be retried: the document's failure row carries it (so its retry
    count grows with each attempt) until a commit of this version resolves it."""
    failure = classify(error)
    DOCUMENTS_RETRIED.labels(step, failure.code).inc()
    return await store.record_failure(
        header, step=step, code=failure.code, message=failure.message, retryable=failure.retryable, retrying=True
    )
