"""DashScopeReranker against the fake DashScope, and the retriever's fallback when it fails."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.retrieval import HybridRetriever, RetrievalSettings, SearchFilters, SearchRequest, SearchResponse
from ragstream.retrieval.rerank import RERANK_PATH, DashScopeReranker, Reranker, RerankError
from ragstream.runtime import Runtime, create_reranker
from ragstream.settings import Settings
from ragstream.storage.citations import CitationStore
from ragstream.storage.search import SearchStore

# The fake vendors listen on 127.0.0.1.
pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

pytest_plugins = ["tests.support.fake_dashscope"]

FAST: dict[str, Any] = {"backoff_initial_s": 0.001, "backoff_max_s": 0.005}
QUERY = "what is the retention of the trades topic"

MakeReranker = Callable[..., DashScopeReranker]


@pytest.fixture
async def make_reranker(fake_dashscope: FakeDashScope) -> AsyncIterator[MakeReranker]:
    """Build rerankers pointed at the fake and close them after the test."""
    made: list[DashScopeReranker] = []

    def make(**kwargs: Any) -> DashScopeReranker:
        options: dict[str, Any] = {"api_key": fake_dashscope.api_key, "base_url": fake_dashscope.base_url, **FAST}
        options.update(kwargs)
        reranker = DashScopeReranker(**options)
        made.append(reranker)
        return reranker

    yield make
    for reranker in made:
        await reranker.aclose()


def overlap(query: str, text: str) -> float:
    """The fake's relevance: the share of query tokens found in the text."""
    # Imported here: a module-level import would load the fake before pytest registers it as a
    # plugin, and pytest could then no longer rewrite its asserts.
    from tests.support.fake_dashscope import tokenize

    wanted = set(tokenize(query))
    return round(len(wanted & set(tokenize(text))) / len(wanted), 6)


# -- the client ---------------------------------------------------------------------------------


async def test_answers_indexes_into_the_texts_best_first(
    fake_dashscope: FakeDashScope, make_reranker: MakeReranker
) -> None:
    texts = ["nothing relevant here", "the trades topic", QUERY, "trades"]

    order = await make_reranker().rerank(QUERY, texts, top_n=3)

    assert order == [(2, 1.0), (1, overlap(QUERY, texts[1])), (3, overlap(QUERY, texts[3]))]
    (body,) = fake_dashscope.bodies(RERANK_PATH)
    assert body == {
        "model": "gte-rerank-v2",
        "input": {"query": QUERY, "documents": texts},
        "parameters": {"top_n": 3, "return_documents": False},
    }


async def test_no_texts_sends_no_request(fake_dashscope: FakeDashScope, make_reranker: MakeReranker) -> None:
    assert await make_reranker().rerank(QUERY, [], top_n=5) == []
    assert fake_dashscope.requests == 0


@pytest.mark.parametrize(
    ("count", "length", "max_request_chars", "sizes"),
    [
        (1200, 8, 30_000, [500, 500, 200]),  # the 500-document cap
        (7, 3000, 10_000, [3, 3, 1]),  # the per-request budget: (query + document) per document
    ],
)
async def test_large_candidate_sets_are_split_and_merged(
    fake_dashscope: FakeDashScope,
    make_reranker: MakeReranker,
    count: int,
    length: int,
    max_request_chars: int,
    sizes: list[int],
) -> None:
    # Only every fifth text mentions the query, so the best ones sit in different requests.
    texts = [("trades " if i % 5 == 0 else "other ").ljust(length, "x")[:length] for i in range(count)]

    order = await make_reranker(max_request_chars=max_request_chars).rerank("trades", texts, top_n=count)

    assert sorted(len(body["input"]["documents"]) for body in fake_dashscope.bodies(RERANK_PATH)) == sorted(sizes)
    assert [index for index, _ in order] == [i for i in range(count) if i % 5 == 0] + [i for i in range(count) if i % 5]


async def test_long_texts_are_cut_to_the_item_limit(fake_dashscope: FakeDashScope, make_reranker: MakeReranker) -> None:
    await make_reranker().rerank("q" * 5000, ["d" * 9000], top_n=1)

    (body,) = fake_dashscope.bodies(RERANK_PATH)
    assert len(body["input"]["query"]) == 4000 and len(body["input"]["documents"][0]) == 4000


async def test_throttling_is_retried(fake_dashscope: FakeDashScope, make_reranker: MakeReranker) -> None:
    fake_dashscope.throttle_next(1, status=400)

    assert (await make_reranker(max_retries=1).rerank(QUERY, ["trades", "other"], top_n=1))[0][0] == 0
    assert fake_dashscope.requests == 2


async def test_a_long_retry_after_is_cut_to_the_rerankers_budget(
    fake_dashscope: FakeDashScope, make_reranker: MakeReranker, caplog: pytest.LogCaptureFixture
) -> None:
    fake_dashscope.throttle_next(1, retry_after="30")

    with caplog.at_level(logging.WARNING):
        ranked = await make_reranker(max_retries=1, backoff_max_s=0.02).rerank(QUERY, ["trades", "other"], top_n=1)

    assert ranked[0][0] == 0 and fake_dashscope.requests == 2
    # The search waits seconds for a reranker, so the service's 30 s become backoff_max_s.
    assert "retrying in 0.02s" in caplog.text


async def test_errors_never_show_the_key(fake_dashscope: FakeDashScope, make_reranker: MakeReranker) -> None:
    fake_dashscope.echo_key_in_errors = True
    wrong = "sk-wrong-key-that-must-not-leak"

    with pytest.raises(RerankError) as caught:
        await make_reranker(api_key=wrong).rerank(QUERY, ["a", "b"], top_n=1)

    assert wrong not in str(caught.value) and "InvalidApiKey" in str(caught.value)
    assert not caught.value.retryable and caught.value.__cause__ is None
    assert fake_dashscope.requests == 1  # a bad key is not retried


async def test_an_index_outside_the_documents_is_an_error(
    fake_dashscope: FakeDashScope, make_reranker: MakeReranker
) -> None:
    fake_dashscope.rerank_out_of_range = True

    with pytest.raises(RerankError, match=r"index \d+ outside 0\.\.1"):
        await make_reranker().rerank(QUERY, ["a", "b"], top_n=2)


def test_settings_build_the_reranker_only_when_asked(fake_dashscope: FakeDashScope) -> None:
    assert create_reranker(Settings()) is None
    with pytest.raises(ValueError, match="RAGSTREAM_DASHSCOPE_API_KEY"):
        Settings(reranker="dashscope")
    reuse = Settings.model_validate(
        {"reranker": "dashscope", "embedding": {"provider": "dashscope", "api_key": fake_dashscope.api_key}}
    )
    assert isinstance(create_reranker(reuse), DashScopeReranker)


# -- the retriever ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def scope(runtime: Runtime, tmp_path_factory: pytest.TempPathFactory) -> SearchFilters:
    """Documents, indexed once for this module, that the fake reranker orders unlike the legs.

    ``chatter.md`` shares only stop words with ``QUERY``: neither leg can rank it high, yet it has
    the most query tokens, which is all the fake reranker counts.
    """
    folder = tmp_path_factory.mktemp("rerank-corpus")
    documents = {
        "trades.md": "# Trades\n\nTrades topic retention: thirty days.\n",
        "orderbook.md": "# Orderbook\n\nOrderbook topic retention: nine days.\n",
        "chatter.md": "# Chatter\n\nWhat is this? It is the one of them, and what of it?\n",
    }
    for name, text in documents.items():
        (folder / name).write_text(text)
    assert (await runtime.pipeline().sync(FolderConnector(folder))).ok
    return SearchFilters(connection_ids=[FolderConnector(folder).connection_id])


def retriever(runtime: Runtime, reranker: Reranker | None, **settings: Any) -> HybridRetriever:
    return HybridRetriever(
        SearchStore(runtime.pool),
        runtime.embedder,
        CitationStore(runtime.pool),
        settings=RetrievalSettings(**settings),
        reranker=reranker,
    )


def chunks(response: SearchResponse) -> list[str]:
    return [result.chunk_id for result in response.results]


@pytest.mark.integration
async def test_search_follows_the_reranker(
    runtime: Runtime, scope: SearchFilters, make_reranker: MakeReranker, fake_dashscope: FakeDashScope
) -> None:
    request = SearchRequest(query=QUERY, top_k=3, filters=scope)
    fused = await retriever(runtime, None).search(request)

    reranked = await retriever(runtime, make_reranker()).search(request)

    assert not fused.reranked and reranked.reranked
    assert (fused.results[0].source, reranked.results[0].source) == ("trades.md", "chatter.md")
    expected = sorted(fused.results, key=lambda result: -overlap(QUERY, result.text))
    assert chunks(reranked) == [result.chunk_id for result in expected]
    assert [result.score for result in reranked.results] == [overlap(QUERY, r.text) for r in expected]
    assert [result.rank for result in reranked.results] == [1, 2, 3]
    assert fake_dashscope.bodies(RERANK_PATH)[0]["parameters"]["top_n"] == 3


def server_error(fake: FakeDashScope) -> None:
    fake.server_error_next(10)


def slow_answer(fake: FakeDashScope) -> None:
    fake.delay_next(1, 1.5)


def garbage_index(fake: FakeDashScope) -> None:
    fake.rerank_out_of_range = True


def bad_key(fake: FakeDashScope) -> None:
    fake.api_key = "sk-another-key"


@pytest.mark.integration
@pytest.mark.parametrize("fault", [server_error, slow_answer, garbage_index, bad_key])
async def test_search_keeps_the_fused_order_when_the_reranker_fails(
    runtime: Runtime,
    scope: SearchFilters,
    make_reranker: MakeReranker,
    fake_dashscope: FakeDashScope,
    fault: Callable[[FakeDashScope], None],
) -> None:
    request = SearchRequest(query=QUERY, top_k=3, filters=scope)
    fused = await retriever(runtime, None).search(request)
    key = fake_dashscope.api_key
    fault(fake_dashscope)
    try:
        response = await retriever(runtime, make_reranker(api_key=key, max_retries=2), rerank_timeout_s=0.5).search(
            request
        )
    finally:
        fake_dashscope.api_key = key

    assert not response.reranked
    assert chunks(response) == chunks(fused)
    assert [result.score for result in response.results] == [result.score for result in fused.results]
    assert fake_dashscope.bodies(RERANK_PATH)  # the reranker was asked, and its failure absorbed
