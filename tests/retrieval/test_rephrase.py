"""DashScopeChatRephraser against the fake DashScope, and the retriever's use of it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.retrieval import (
    ChatTurn,
    HybridRetriever,
    RetrievalSettings,
    SearchFilters,
    SearchRequest,
    SearchResponse,
)
from ragstream.retrieval.rephrase import CHAT_PATH as CHAT_ROUTE
from ragstream.retrieval.rephrase import SYSTEM_PROMPT, DashScopeChatRephraser, RephraseError, Rephrasing
from ragstream.retrieval.rerank import RERANK_PATH
from ragstream.runtime import Runtime, create_rephraser, open_runtime
from ragstream.settings import Settings
from ragstream.storage.citations import CitationStore
from ragstream.storage.search import SearchStore
from tests.support.fake_dashscope import CHITCHAT_REPLY

# The fake vendors listen on 127.0.0.1.
pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

pytest_plugins = ["tests.support.fake_dashscope"]

FAST: dict[str, Any] = {"backoff_initial_s": 0.001, "backoff_max_s": 0.005}
HISTORY = [
    ChatTurn(role="user", content="What is the retention period for the orderbook topic?"),
    ChatTurn(role="assistant", content="The orderbook topic keeps data for 9 days [1]."),
]
FOLLOW_UP = "And for the trades topic?"
STANDALONE = "What is the retention period for the trades topic?"
CHAT_PATH = "/compatible-mode/v1" + CHAT_ROUTE

MakeRephraser = Callable[..., DashScopeChatRephraser]


@pytest.fixture
async def make_rephraser(fake_dashscope: FakeDashScope) -> AsyncIterator[MakeRephraser]:
    """Build rephrasers pointed at the fake's compatible mode and close them after the test."""
    made: list[DashScopeChatRephraser] = []

    def make(**kwargs: Any) -> DashScopeChatRephraser:
        options: dict[str, Any] = {
            "api_key": fake_dashscope.api_key,
            "base_url": f"{fake_dashscope.base_url}/compatible-mode/v1",
            **FAST,
        }
        options.update(kwargs)
        rephraser = DashScopeChatRephraser(**options)
        made.append(rephraser)
        return rephraser

    yield make
    for rephraser in made:
        await rephraser.aclose()


# -- the client ---------------------------------------------------------------------------------


async def test_rewrites_a_follow_up_from_the_history(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser
) -> None:
    assert await make_rephraser().rephrase(FOLLOW_UP, HISTORY) == Rephrasing("rephrased", STANDALONE)

    (body,) = fake_dashscope.bodies(CHAT_PATH)
    assert (body["model"], body["temperature"]) == ("qwen-plus", 0)
    assert body["response_format"] == {"type": "json_object"}
    system, user = body["messages"]
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    assert user["role"] == "user"
    assert json.loads(user["content"]) == {
        "history": [turn.model_dump() for turn in HISTORY],
        "question": FOLLOW_UP,
        "user_context": {},
    }


async def test_a_greeting_is_answered_as_chitchat(make_rephraser: MakeRephraser) -> None:
    decided = await make_rephraser().rephrase("Hello there!", HISTORY)

    assert decided == Rephrasing("chitchat", "", reply=CHITCHAT_REPLY)


async def test_an_incomplete_question_is_completed_from_the_user_context(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser
) -> None:
    decided = await make_rephraser().rephrase("What is the leave policy?", [], {"department": "sales"})

    assert decided == Rephrasing("enriched", "What is the leave policy of the sales department?")
    (body,) = fake_dashscope.bodies(CHAT_PATH)
    assert json.loads(body["messages"][1]["content"])["user_context"] == {"department": "sales"}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('{"outcome": "chitchat", "reply": " Hi! "}', Rephrasing("chitchat", "", reply="Hi!")),
        ('{"outcome": "rephrase", "question": "\u201cWhat is X?\u201d"}', Rephrasing("rephrased", "What is X?")),
        ('{"outcome": "enrich", "question": "X 的保留期是多久？"}', Rephrasing("enriched", "X 的保留期是多久？")),
    ],
)
async def test_each_json_outcome_is_read(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser, answer: str, expected: Rephrasing
) -> None:
    fake_dashscope.chat_content = answer

    assert await make_rephraser().rephrase(FOLLOW_UP, HISTORY) == expected


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ('{"outcome": "answer", "question": "What is X?"}', "no known outcome"),
        ('{"outcome": "chitchat"}', "no reply"),
        ('{"outcome": "enrich", "question": "  "}', "no question"),
        ('["rephrase", "What is X?"]', "no known outcome"),
    ],
)
async def test_a_json_answer_of_no_outcome_is_an_error(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser, answer: str, reason: str
) -> None:
    fake_dashscope.chat_content = answer

    with pytest.raises(RephraseError, match=reason) as caught:
        await make_rephraser().rephrase(FOLLOW_UP, HISTORY)
    assert not caught.value.retryable


async def test_only_recent_turns_go_out_and_each_is_capped(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser
) -> None:
    history = [ChatTurn(role="user" if i % 2 else "assistant", content=f"turn {i} " * 500) for i in range(10)]

    await make_rephraser().rephrase("你好，还有呢？", history)

    (body,) = fake_dashscope.bodies(CHAT_PATH)
    sent = json.loads(body["messages"][1]["content"])
    assert [turn["content"].split()[1] for turn in sent["history"]] == ["4", "5", "6", "7", "8", "9"]
    assert all(len(turn["content"]) == 2000 for turn in sent["history"])
    assert "你好" in body["messages"][1]["content"]  # not \\u-escaped


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('  "What is X?"\n', "What is X?"),
        ("「X 的保留期是多久？」", "X 的保留期是多久？"),
        ("Why 'quoted' words stay", "Why 'quoted' words stay"),
    ],
)
async def test_a_bare_question_is_read_as_a_rephrase_stripped_of_whitespace_and_quotes(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser, answer: str, expected: str
) -> None:
    fake_dashscope.chat_content = answer

    assert await make_rephraser().rephrase(FOLLOW_UP, HISTORY) == Rephrasing("rephrased", expected)


async def test_an_empty_answer_is_an_error(fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser) -> None:
    fake_dashscope.chat_content = ' "" '

    with pytest.raises(RephraseError, match="empty"):
        await make_rephraser().rephrase(FOLLOW_UP, HISTORY)


async def test_server_errors_are_retried_then_raised(
    fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser
) -> None:
    fake_dashscope.server_error_next(2)

    with pytest.raises(RephraseError, match="InternalError") as caught:
        await make_rephraser(max_retries=1).rephrase(FOLLOW_UP, HISTORY)

    assert caught.value.retryable and fake_dashscope.requests == 2


async def test_errors_never_show_the_key(fake_dashscope: FakeDashScope, make_rephraser: MakeRephraser) -> None:
    fake_dashscope.echo_key_in_errors = True
    wrong = "sk-wrong-key-that-must-not-leak"

    with pytest.raises(RephraseError) as caught:
        await make_rephraser(api_key=wrong).rephrase(FOLLOW_UP, HISTORY)

    assert wrong not in str(caught.value) and "invalid_api_key" in str(caught.value)
    assert not caught.value.retryable and caught.value.__cause__ is None


def test_settings_build_the_rephraser_only_when_asked(fake_dashscope: FakeDashScope) -> None:
    assert create_rephraser(Settings()) is None
    with pytest.raises(ValueError, match="RAGSTREAM_DASHSCOPE_API_KEY"):
        Settings(rephraser="dashscope")
    assert isinstance(
        create_rephraser(Settings(rephraser="dashscope", dashscope_api_key=fake_dashscope.api_key)),
        DashScopeChatRephraser,
    )


# -- the retriever ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def scope(runtime: Runtime, tmp_path_factory: pytest.TempPathFactory) -> SearchFilters:
    """Retention of two topics, indexed once for this module."""
    folder = tmp_path_factory.mktemp("rephrase-corpus")
    (folder / "orderbook.md").write_text("# Orderbook\n\nThe retention period for the orderbook topic is 9 days.\n")
    (folder / "trades.md").write_text("# Trades\n\nThe retention period for the trades topic is 30 days.\n")
    (folder / "schema.md").write_text("# Schema\n\nEach message of the trades topic has a price and a size.\n")
    (folder / "leave-sales.md").write_text(
        "# Sales leave policy\n\nThe leave policy of the sales department grants 25 days off, booked in the CRM.\n"
    )
    (folder / "leave-engineering.md").write_text(
        "# Engineering leave policy\n\nThe leave policy of the engineering department grants 28 days off.\n"
    )
    assert (await runtime.pipeline().sync(FolderConnector(folder))).ok
    return SearchFilters(connection_ids=[FolderConnector(folder).connection_id])


def retriever(runtime: Runtime, rephraser: DashScopeChatRephraser | None, **settings: Any) -> HybridRetriever:
    return HybridRetriever(
        SearchStore(runtime.pool),
        runtime.embedder,
        CitationStore(runtime.pool),
        settings=RetrievalSettings(**settings),
        rephraser=rephraser,
    )


def chunks(response: SearchResponse) -> list[str]:
    return [result.chunk_id for result in response.results]


@pytest.mark.integration
async def test_search_runs_the_standalone_question(
    runtime: Runtime, scope: SearchFilters, make_rephraser: MakeRephraser
) -> None:
    request = SearchRequest(query=FOLLOW_UP, history=HISTORY, top_k=3, filters=scope)

    response = await retriever(runtime, make_rephraser()).search(request)
    direct = await retriever(runtime, None).search(SearchRequest(query=STANDALONE, top_k=3, filters=scope))

    assert (response.query, response.rewritten_query) == (FOLLOW_UP, STANDALONE)
    assert chunks(response) == chunks(direct)
    assert response.results[0].source == "trades.md"


@pytest.mark.integration
async def test_a_caller_that_opts_out_is_searched_without_asking_the_model(
    runtime: Runtime, scope: SearchFilters, make_rephraser: MakeRephraser, fake_dashscope: FakeDashScope
) -> None:
    request = SearchRequest(query=FOLLOW_UP, history=HISTORY, filters=scope, rephrase=False)

    response = await retriever(runtime, make_rephraser()).search(request)

    assert (response.rewritten_query, response.rephrase_outcome) == (None, "original") and response.results
    assert fake_dashscope.requests == 0


@pytest.mark.integration
async def test_a_standalone_question_is_searched_as_sent(
    runtime: Runtime, scope: SearchFilters, make_rephraser: MakeRephraser, fake_dashscope: FakeDashScope
) -> None:
    response = await retriever(runtime, make_rephraser()).search(SearchRequest(query=STANDALONE, filters=scope))

    assert (response.rewritten_query, response.rephrase_outcome) == (None, "original") and response.results
    assert fake_dashscope.requests == 1


@pytest.mark.integration
async def test_chitchat_is_answered_without_searching(
    runtime: Runtime, scope: SearchFilters, make_rephraser: MakeRephraser, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_search(*args: Any) -> None:
        raise AssertionError("chit-chat must not reach the index")

    searcher = retriever(runtime, make_rephraser())
    monkeypatch.setattr(searcher, "_candidates", no_search)

    response = await searcher.search(SearchRequest(query="Thanks, that helps!", history=HISTORY, filters=scope))

    assert (response.rephrase_outcome, response.reply, response.results) == ("chitchat", CHITCHAT_REPLY, [])


@pytest.mark.integration
async def test_an_incomplete_question_searches_the_callers_department(
    runtime: Runtime, scope: SearchFilters, make_rephraser: MakeRephraser
) -> None:
    request = SearchRequest(
        query="What is the leave policy?", user_context={"department": "sales"}, top_k=2, filters=scope
    )

    response = await retriever(runtime, make_rephraser()).search(request)

    assert response.rephrase_outcome == "enriched"
    assert response.rewritten_query == "What is the leave policy of the sales department?"
    assert response.results[0].source == "leave-sales.md"


def server_error(fake: FakeDashScope) -> None:
    fake.server_error_next(10)


def slow_answer(fake: FakeDashScope) -> None:
    fake.delay_next(1, 1.5)


def blank_answer(fake: FakeDashScope) -> None:
    fake.chat_content = "   "


def bad_request(fake: FakeDashScope) -> None:
    fake.fail_next(1, status=400, code="DataInspectionFailed", message="Input data may contain inappropriate content.")


@pytest.mark.integration
@pytest.mark.parametrize("fault", [server_error, slow_answer, blank_answer, bad_request])
async def test_search_runs_the_raw_question_when_rephrasing_fails(
    runtime: Runtime,
    scope: SearchFilters,
    make_rephraser: MakeRephraser,
    fake_dashscope: FakeDashScope,
    fault: Callable[[FakeDashScope], None],
) -> None:
    raw = await retriever(runtime, None).search(SearchRequest(query=FOLLOW_UP, top_k=3, filters=scope))
    fault(fake_dashscope)

    response = await retriever(runtime, make_rephraser(max_retries=2), rephrase_timeout_s=0.5).search(
        SearchRequest(query=FOLLOW_UP, history=HISTORY, top_k=3, filters=scope)
    )

    assert response.rewritten_query is None
    assert chunks(response) == chunks(raw)
    assert fake_dashscope.bodies(CHAT_PATH)  # the model was asked, and its failure absorbed


@pytest.mark.integration
async def test_runtime_wires_reranker_and_rephraser_from_settings(
    database_url: str, scope: SearchFilters, fake_dashscope: FakeDashScope
) -> None:
    settings = Settings(
        database_url=database_url,
        reranker="dashscope",
        rephraser="dashscope",
        dashscope_api_key=fake_dashscope.api_key,
        dashscope_base_url=fake_dashscope.base_url,
    )
    async with open_runtime(settings, database_url) as wired:
        response = await wired.retriever.search(SearchRequest(query=FOLLOW_UP, history=HISTORY, top_k=2, filters=scope))

    assert response.rewritten_query == STANDALONE and response.reranked
    assert response.results[0].source == "trades.md"
    assert fake_dashscope.bodies(RERANK_PATH)[0]["input"]["query"] == STANDALONE
