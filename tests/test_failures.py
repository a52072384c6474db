"""The one classification of stage errors: which are retried within a stage, and under which code."""

from __future__ import annotations

import asyncpg
import pytest

from ragstream.embedding.base import EmbeddingError
from ragstream.failures import StageRetry, classify, is_transient
from ragstream.parsing import ParseError, ParseErrorCode


@pytest.mark.parametrize(
    ("error", "transient", "code", "retryable"),
    [
        (EmbeddingError("503", retryable=True, provider="p"), True, "embedding_unavailable", True),
        (EmbeddingError("400", retryable=False, provider="p"), False, "embedding_rejected", False),
        (TimeoutError("read timed out"), True, "TimeoutError", True),
        (ConnectionResetError("reset by peer"), True, "ConnectionResetError", True),
        (ParseError(ParseErrorCode.EMPTY, "no text"), False, "empty", False),
        (ParseError(ParseErrorCode.TOO_LARGE, "17 MB"), False, "too_large", False),
        (ParseError(ParseErrorCode.PARSE_TIMEOUT, "60 s"), False, "parse_timeout", False),
        # Text PostgreSQL refuses fails the same way on every attempt; no raw asyncpg class as code.
        (asyncpg.CharacterNotInRepertoireError("invalid byte sequence"), False, "unstorable_text", False),
        (asyncpg.UntranslatableCharacterError("\\u0000"), False, "unstorable_text", False),
        (asyncpg.DeadlockDetectedError("deadlock"), False, "database_error", True),
        # A bug or a bad config: a replay may fix it later, waiting a second will not.
        (ValueError("invalid chunking config"), False, "ValueError", True),
    ],
)
def test_classification(error: Exception, transient: bool, code: str, retryable: bool) -> None:
    assert is_transient(error) is transient
    failure = classify(error)
    assert (failure.code, failure.retryable) == (code, retryable)


async def test_retry_stops_at_the_first_permanent_error_and_after_the_last_attempt() -> None:
    retry = StageRetry(attempts=4, backoff_s=0, backoff_max_s=0)
    seen: list[str] = []

    async def record(error: Exception) -> None:
        seen.append(str(error))

    async def always(error: Exception) -> None:
        raise error

    with pytest.raises(TimeoutError):
        await retry.run(lambda: always(TimeoutError("slow")), record)
    assert seen == ["slow"] * 3  # four attempts, three retries
    seen.clear()
    with pytest.raises(ParseError):
        await retry.run(lambda: always(ParseError(ParseErrorCode.BINARY, "binary")), record)
    assert seen == []
    with pytest.raises(ValueError, match="at least one attempt"):
        StageRetry(attempts=0)
