"""DashScopeEmbedder against the fake DashScope over real HTTP: batching, pacing, retries, errors."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest

from ragstream.embedding.base import Embedder, EmbeddingError
from ragstream.embedding.dashscope import EMBEDDING_PATH, DashScopeEmbedder

# The fake vendors listen on 127.0.0.1.
pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

# Registered as a plugin rather than imported, so pytest can rewrite its asserts and ruff does not
# mistake the fixture arguments for redefinitions.
pytest_plugins = ["tests.support.fake_dashscope"]

# Waits of a few milliseconds keep the retry tests fast while still going through tenacity.
FAST: dict[str, Any] = {"backoff_initial_s": 0.001, "backoff_max_s": 0.005}

MakeEmbedder = Callable[..., DashScopeEmbedder]


@pytest.fixture
async def make_embedder(fake_dashscope: FakeDashScope) -> AsyncIterator[MakeEmbedder]:
    """Build embedders pointed at the fake and close them after the test."""
    made: list[DashScopeEmbedder] = []

    def make(**kwargs: Any) -> DashScopeEmbedder:
        options: dict[str, Any] = {
            "api_key": fake_dashscope.api_key,
            "base_url": fake_dashscope.base_url,
            **FAST,
        }
        options.update(kwargs)
        embedder = DashScopeEmbedder(**options)
        made.append(embedder)
        return embedder

    yield make
    for embedder in made:
        await embedder.aclose()


def texts_(n: int) -> list[str]:
    return [f"chunk number {i} about topic {i % 7}" for i in range(n)]


def error_chain(exc: BaseException | None) -> str:
    parts: list[str] = []
    while exc is not None:
        parts.append(f"{exc!s} {exc!r}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


async def test_satisfies_embedder_protocol(make_embedder: MakeEmbedder) -> None:
    embedder = make_embedder(dimension=512)
    assert isinstance(embedder, Embedder)
    assert embedder.model_key == "dashscope-text-embedding-v3-512"
    assert embedder.dimension == 512


async def test_vectors_are_float32_unit_length_and_match_texts(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.unnormalized = True
    texts = ["hello world", "hello world", "你好，世界"]

    vectors = await make_embedder().embed(texts)

    assert vectors.dtype == np.float32
    assert vectors.shape == (3, 1024)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts), atol=1e-5)
    np.testing.assert_array_equal(vectors[0], vectors[1])


async def test_request_body_follows_the_native_api(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    await make_embedder(model="text-embedding-v4").embed(["a b"])

    [body] = fake_dashscope.bodies(EMBEDDING_PATH)
    assert body == {
        "model": "text-embedding-v4",
        "input": {"texts": ["a b"]},
        "parameters": {"dimension": 1024, "text_type": "document", "output_type": "dense"},
    }


async def test_95_texts_go_out_as_10_requests_of_at_most_10(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    texts = texts_(95)

    vectors = await make_embedder().embed(texts)

    sizes = sorted(len(b["input"]["texts"]) for b in fake_dashscope.bodies())
    assert fake_dashscope.requests == 10
    assert sizes == [5] + [10] * 9
    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts), atol=1e-5)


async def test_smaller_batch_size_is_honoured(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    await make_embedder(batch_size=6).embed(texts_(13))

    assert sorted(len(b["input"]["texts"]) for b in fake_dashscope.bodies()) == [1, 6, 6]


@pytest.mark.parametrize("batch_size", [0, 11])
def test_batch_size_outside_the_service_limit_is_refused(batch_size: int) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        DashScopeEmbedder(api_key="sk-x", batch_size=batch_size)


async def test_at_most_max_concurrency_requests_in_flight(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.delay_s = 0.05

    await make_embedder(max_concurrency=5).embed(texts_(95))

    assert fake_dashscope.requests == 10
    # Equal to the cap, not just below it: the batches really do run in parallel.
    assert fake_dashscope.max_in_flight == 5


async def test_concurrency_cap_spans_concurrent_embed_calls(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.delay_s = 0.03
    embedder = make_embedder(max_concurrency=3)

    await asyncio.gather(*(embedder.embed(texts_(30)) for _ in range(3)))

    assert fake_dashscope.requests == 9
    assert fake_dashscope.max_in_flight == 3


async def test_order_follows_text_index_not_list_position(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.shuffle = True
    texts = texts_(40)

    vectors = await make_embedder().embed(texts)

    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts), atol=1e-5)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (429, "Throttling.RateQuota"),
        (429, "Throttling"),
        (429, "Throttling.AllocationQuota"),
        # One client sees the rate-quota code with HTTP 400 (§6.4): the code decides.
        (400, "Throttling.RateQuota"),
        (400, "Throttling.AllocationQuota"),
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
        (408, "RequestTimeOut"),
    ],
)
async def test_transient_errors_are_retried_until_success(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, status: int, code: str
) -> None:
    fake_dashscope.fail_next(2, status=status, code=code)
    texts = texts_(3)

    vectors = await make_embedder(max_retries=5).embed(texts)

    assert fake_dashscope.requests == 3
    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts), atol=1e-5)


async def test_retries_are_logged_without_the_key(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    fake_dashscope.throttle_next(1)

    with caplog.at_level(logging.DEBUG):
        await make_embedder().embed(["x"])

    assert "Throttling.RateQuota" in caplog.text
    assert "retrying" in caplog.text
    assert fake_dashscope.api_key not in caplog.text


async def test_a_throttled_request_waits_what_the_service_asks(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    fake_dashscope.throttle_next(1, retry_after="0.25")

    with caplog.at_level(logging.WARNING):
        vectors = await make_embedder().embed(["x"])

    assert vectors.shape == (1, 1024) and fake_dashscope.requests == 2
    # The service's wait, not the few milliseconds of FAST's backoff.
    assert "retrying in 0.25s" in caplog.text


async def test_persistent_throttling_gives_up_with_a_retryable_error(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.throttle_next(10, status=400)

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder(max_retries=3).embed(["x"])

    assert caught.value.retryable is True
    assert caught.value.provider == "dashscope"
    assert "Throttling.RateQuota" in str(caught.value)
    assert fake_dashscope.requests == 4


async def test_a_slow_request_is_retried_after_the_timeout(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.delay_next(1, 0.5)

    vectors = await make_embedder(timeout_s=0.2).embed(["x"])

    assert vectors.shape == (1, 1024)
    assert fake_dashscope.requests == 2


async def test_timeouts_exhaust_retries_into_a_retryable_error(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.delay_s = 0.5

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder(timeout_s=0.1, max_retries=2).embed(["x"])

    assert caught.value.retryable is True
    assert "timed out" in str(caught.value)
    assert fake_dashscope.requests == 3


async def test_connection_refused_is_retried_then_retryable() -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    embedder = DashScopeEmbedder(api_key="sk-secret-value", base_url=f"http://127.0.0.1:{port}", max_retries=2, **FAST)
    try:
        with pytest.raises(EmbeddingError) as caught:
            await embedder.embed(["x"])
    finally:
        await embedder.aclose()

    assert caught.value.retryable is True
    assert "connection failed" in str(caught.value)
    assert "sk-secret-value" not in error_chain(caught.value)


@pytest.mark.parametrize("echo", [False, True])
async def test_wrong_key_fails_at_once_without_revealing_it(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, echo: bool
) -> None:
    fake_dashscope.echo_key_in_errors = echo
    wrong_key = "sk-wrong-key-that-must-not-leak"

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder(api_key=wrong_key, max_retries=5).embed(texts_(3))

    assert caught.value.retryable is False
    assert fake_dashscope.requests == 1
    message = str(caught.value)
    assert "HTTP 401 InvalidApiKey" in message
    assert "request_id=" in message
    assert wrong_key not in error_chain(caught.value)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, "InvalidParameter"),
        (400, "DataInspectionFailed"),
        (400, "Arrearage"),
        (403, "AccessDenied.Unpurchased"),
        (413, "BadRequest.TooLarge"),
    ],
)
async def test_permanent_errors_are_not_retried(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, status: int, code: str
) -> None:
    fake_dashscope.fail_next(1, status=status, code=code, message="no")

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder().embed(["x"])

    assert caught.value.retryable is False
    assert code in str(caught.value)
    assert fake_dashscope.requests == 1


async def test_a_batch_over_the_server_cap_is_a_permanent_error(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder
) -> None:
    fake_dashscope.batch_cap = 6

    with pytest.raises(EmbeddingError) as caught:
        await make_embedder(batch_size=10).embed(texts_(10))

    assert caught.value.retryable is False
    assert "InvalidParameter" in str(caught.value)


@pytest.mark.parametrize("dimension", [64, 512, 768])
async def test_dimension_is_sent_and_honoured(
    fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, dimension: int
) -> None:
    texts = texts_(3)

    vectors = await make_embedder(dimension=dimension).embed(texts)

    assert vectors.shape == (3, dimension)
    assert fake_dashscope.bodies()[0]["parameters"]["dimension"] == dimension
    np.testing.assert_allclose(vectors, fake_dashscope.expected_vectors(texts, dimension), atol=1e-5)


@pytest.mark.parametrize("kind", ["query", "document"])
async def test_text_type_follows_kind(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder, kind: Any) -> None:
    await make_embedder().embed(["x"], kind=kind)

    assert fake_dashscope.bodies()[0]["parameters"]["text_type"] == kind


async def test_empty_input_makes_no_request(fake_dashscope: FakeDashScope, make_embedder: MakeEmbedder) -> None:
    vectors = await make_embedder(dimension=256).embed([])

    assert vectors.shape == (0, 256)
    assert vectors.dtype == np.float32
    assert fake_dashscope.requests == 0


# Malformed 2xx answers cannot be provoked from a well-behaved fake, so these few go through
# httpx.MockTransport; everything else above uses real HTTP.
def _answer(embeddings: list[dict[str, Any]]) -> httpx.MockTransport:
    # json.dumps, not httpx's encoder, so a NaN can be sent the way a sloppy server would.
    content = json.dumps({"request_id": "req-1", "output": {"embeddings": embeddings}})

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=content.encode())

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    ("embeddings", "reason"),
    [
        ([{"text_index": 0, "embedding": [1.0, 0.0]}], "dimension 2, expected 4"),
        ([{"text_index": 0, "embedding": [1.0] * 4}] * 2, "2 vectors for 1 texts"),
        ([{"text_index": 3, "embedding": [1.0] * 4}], "text_index 3 outside"),
        ([{"text_index": 0, "embedding": [float("nan")] * 4}], "NaN"),
        ([], "0 vectors for 1 texts"),
    ],
)
async def test_malformed_answers_are_permanent_errors(embeddings: list[dict[str, Any]], reason: str) -> None:
    embedder = DashScopeEmbedder(api_key="sk-x", dimension=4, transport=_answer(embeddings))
    try:
        with pytest.raises(EmbeddingError, match=reason) as caught:
            await embedder.embed(["x"])
    finally:
        await embedder.aclose()

    assert caught.value.retryable is False
    assert "request_id=req-1" in str(caught.value)


async def test_duplicate_text_index_is_rejected() -> None:
    items = [{"text_index": 0, "embedding": [1.0] * 4}] * 2
    embedder = DashScopeEmbedder(api_key="sk-x", dimension=4, transport=_answer(items))
    try:
        with pytest.raises(EmbeddingError, match="repeats text_index 0"):
            await embedder.embed(["x", "y"])
    finally:
        await embedder.aclose()


async def test_a_non_json_error_page_is_still_classified() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        assert json.loads(request.content)["input"]["texts"] == ["x"]
        if calls == 1:
            return httpx.Response(502, text="<html>Bad Gateway</html>")
        return httpx.Response(
            200,
            json={
                "request_id": "r",
                "output": {"embeddings": [{"text_index": 0, "embedding": [3.0, 4.0]}]},
            },
        )

    embedder = DashScopeEmbedder(api_key="sk-x", dimension=2, transport=httpx.MockTransport(handler), **FAST)
    try:
        vectors = await embedder.embed(["x"])
    finally:
        await embedder.aclose()

    assert calls == 2
    np.testing.assert_allclose(vectors, [[0.6, 0.8]], rtol=1e-6)


async def test_an_endpoint_the_outbound_gate_refuses_is_a_provider_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint is the operator's configuration, so a refusal at send time is the provider's
    failure (a search answers it as the embedder being unavailable), not the caller's invalid input."""
    monkeypatch.setenv("RAGSTREAM_ALLOW_PRIVATE_NETWORKS", "false")
    embedder = DashScopeEmbedder(api_key="sk-x", base_url="http://127.0.0.1:9", max_retries=0, **FAST)
    try:
        with pytest.raises(EmbeddingError) as caught:
            await embedder.embed(["x"])
    finally:
        await embedder.aclose()
    assert not caught.value.retryable and "loopback" in str(caught.value)
