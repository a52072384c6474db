"""OpenAICompatibleEmbedder against the fake's DashScope compatible-mode route over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest

from ragstream.embedding.base import Embedder, EmbeddingError
from ragstream.embedding.openai_compatible import (
    OpenAICompatibleEmbedder,
    parse_openai_error,
)

# The fake vendors listen on 127.0.0.1.
pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

pytest_plugins = ["tests.support.fake_dashscope"]

ROUTE = "/compatible-mode/v1/embeddings"
FAST: dict[str, Any] = {"backoff_initial_s": 0.001, "backoff_max_s": 0.005}

MakeEmbedder = Callable[..., OpenAICompatibleEmbedder]


@pytest.fixture
async def make_embedder(fake_dashscope: FakeDashScope) -> AsyncIterator[MakeEmbedder]:
    """Build embedders pointed at the fake's compatible mode and close them after the test."""
    made: list[OpenAICompatibleEmbedder] = []

    def make(**kwargs: Any) -> OpenAICompatibleEmbedder:
        options: dict[str, Any] = {
            "base_url": f"{fake_dashscope.base_url}/compatible-mode/v1",
            "model": "text-embedding-v3",
            "dimension": 1024,
            "api_key": fake_dashscope.api_key,
            "batch_size": 10,
            **FAST,
        }
        options.update(kwargs)
        embedder = OpenAICompatibleEmbedder(**options)
        made.append(embedder)
        return embedder

    yield make
    for embedder in made:
        await embedder.aclose()


def texts_(n: int) -> list[str]:
    return [f"passage {i} on subject {i % 5}" for i in range(n)]


async def test_satisfies_embedder_protocol(make_embedder: MakeEmbedder) -> None:
    embedder = make_embedder(model="bge-m3", dimension=1024)
    assert isinstance(embedder, Embedder)
    assert embedder.model_key == "openai-compatible-bge-m3-1024"
    assert make_embedder(model_key="dashscope-text-embedding-v3-1024").model_key == ("dashscope-text-embedding-v3-1024")


async def test_request_body_is_openai_shaped(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    await make_embedder().embed(["a", "b"])

    [body] = fake_dashscope.bodies(ROUTE)
    # No "dimensions" unless asked: many self-hosted servers reject the field.
    assert body == {"model": "text-embedding-v3", "input": ["a", "b"], "encoding_format": "float"}


async def test_vectors_ordered_by_index_and_unit_length(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.shuffle = True
    fake_dashscope.unnormalized = True
    texts = texts_(25)

    vectors = await make_embedder().embed(texts)

    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts), atol=1e-5)


async def test_batches_and_concurrency_are_capped(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    fake_dashscope.delay_s = 0.05

    await make_embedder(batch_size=10, max_concurrency=4).embed(texts_(95))

    sizes = sorted(len(b["input"]) for b in fake_dashscope.bodies(ROUTE))
    assert sizes == [5] + [10] * 9
    assert fake_dashscope.max_in_flight == 4


async def test_dimensions_sent_when_asked(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    texts = texts_(3)

    vectors = await make_embedder(dimension=512, send_dimensions=True).embed(texts)

    assert fake_dashscope.bodies(ROUTE)[0]["dimensions"] == 512
    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts, 512), atol=1e-5)


async def test_unexpected_dimension_is_a_permanent_error(make_embedder: MakeEmbedder) -> None:
    # The server's default is 1024; expecting 512 without sending it must not pass silently.
    with pytest.raises(EmbeddingError, match="dimension 1024, expected 512") as caught:
        await make_embedder(dimension=512).embed(["x"])

    assert caught.value.retryable is False


async def test_query_and_document_prefixes(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    embedder = make_embedder(query_prefix="query: ", document_prefix="passage: ")

    await embedder.embed(["q"], kind="query")
    await embedder.embed(["d"], kind="document")

    assert [b["input"] for b in fake_dashscope.bodies(ROUTE)] == [["query: q"], ["passage: d"]]


@pytest.mark.parametrize(
    ("status", "code"),
    [(429, "Throttling.RateQuota"), (400, "Throttling.RateQuota"), (500, "InternalError")],
)
async def test_transient_errors_are_retried(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, status: int, code: str
) -> None:
    fake_dashscope.fail_next(2, status=status, code=code)

    vectors = await make_embedder().embed(texts_(2))

    assert vectors.shape == (2, 1024)
    assert fake_dashscope.requests == 3


async def test_timeouts_exhaust_into_retryable_error(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.delay_s = 0.5

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder(timeout_s=0.1, max_retries=1).embed(["x"])

    assert caught.value.retryable is True
    assert caught.value.provider == "openai-compatible"
    assert fake_dashscope.requests == 2


async def test_wrong_key_is_permanent_and_redacted_even_when_echoed(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.echo_key_in_errors = True
    wrong_key = "sk-compatible-wrong-key"

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder(api_key=wrong_key).embed(texts_(3))

    assert caught.value.retryable is False
    assert fake_dashscope.requests == 1
    assert "HTTP 401 invalid_api_key" in str(caught.value)
    assert "request_id=" in str(caught.value)
    assert wrong_key not in str(caught.value)


async def test_no_key_sends_no_authorization_header(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    with pytest.raises(EmbeddingError, match="No API-key provided"):
        await make_embedder(api_key=None).embed(["x"])

    assert [r.authorized for r in fake_dashscope.received] == [False]


async def test_oversized_batch_error_under_error_key_is_permanent(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    with pytest.raises(EmbeddingError, match="InvalidParameter") as caught:
        await make_embedder(batch_size=32).embed(texts_(20))

    assert caught.value.retryable is False
    assert fake_dashscope.requests == 1


async def test_duplicate_zero_indexes_are_rejected(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    fake_dashscope.duplicate_zero_index = True

    with pytest.raises(EmbeddingError, match="repeats index 0") as caught:
        await make_embedder().embed(texts_(3))

    assert caught.value.retryable is False


async def test_empty_input_makes_no_request(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    vectors = await make_embedder(dimension=8).embed([])

    assert vectors.shape == (0, 8)
    assert fake_dashscope.requests == 0


async def test_concurrent_failures_report_the_permanent_one(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    # One batch is refused while others are still running: the caller gets the refusal, and the
    # remaining batches are cancelled instead of running on.
    fake_dashscope.fail_next(1, status=400, code="DataInspectionFailed", message="unsafe")
    fake_dashscope.delay_s = 0.05

    with pytest.raises(EmbeddingError, match="DataInspectionFailed") as caught:
        await asyncio.wait_for(make_embedder(max_concurrency=2).embed(texts_(50)), 5)

    assert caught.value.retryable is False
    assert fake_dashscope.requests < 5


@pytest.mark.parametrize(
    ("status", "body", "code", "message"),
    [
        # OpenAI / DashScope compatible mode
        (
            429,
            {"error": {"code": "rate_limit_exceeded", "message": "slow down"}, "request_id": "r1"},
            "rate_limit_exceeded",
            "slow down",
        ),
        # vLLM: top-level message, numeric code repeating the status
        (
            400,
            {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400},
            "BadRequestError",
            "too long",
        ),
        # TEI: error is a plain string
        (
            413,
            {"error": "batch too large", "error_type": "Validation"},
            "Validation",
            "batch too large",
        ),
        # FastAPI default
        (422, {"detail": "bad field"}, "", "bad field"),
    ],
)
def test_parse_openai_error_shapes(status: int, body: dict[str, Any], code: str, message: str) -> None:
    info = parse_openai_error(httpx.Response(status, json=body))

    assert (info.status, info.code, info.message) == (status, code, message)


def test_parse_openai_error_without_json() -> None:
    info = parse_openai_error(httpx.Response(503, text="upstream down", headers={"x-request-id": "abc"}))

    assert (info.code, info.message, info.request_id) == ("", "upstream down", "abc")
