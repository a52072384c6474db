"""Direct search beside RAG: RAG-off DingTalk and Yuque connections searched live through the fakes
over real HTTP, merged with the local index of the real PostgreSQL, through the HTTP search API."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.connectors.folder import FolderConnector
from ragstream.credentials import CredentialCipher
from ragstream.retrieval import ChatTurn, HybridRetriever, SearchFilters, SearchRequest
from ragstream.retrieval.direct import DirectSearch
from ragstream.retrieval.rephrase import DashScopeChatRephraser
from ragstream.retrieval.with_direct import SearchWithDirect
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.direct_connections import DirectConnectionStore
from ragstream.storage.search import SearchStore
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.support.fake_dashscope import FakeDashScope
from tests.support.fake_dingtalk import APP_KEY, APP_SECRET, OPERATOR, FakeDingTalk
from tests.support.fake_feishu import FakeFeishu
from tests.support.fake_ima import DEFAULT_API_KEY, DEFAULT_CLIENT_ID, FakeIma
from tests.support.fake_yuque import DEFAULT_TOKEN, FakeYuque

pytest_plugins = [
    "tests.support.fake_dashscope",
    "tests.support.fake_feishu",
    "tests.support.fake_dingtalk",
    "tests.support.fake_ima",
    "tests.support.fake_yuque",
]
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_networks")]

#: Far below the 30-second default, so a slow platform is given up on quickly, yet ample for a
#: failing one's retry on a loaded machine.
TIMEOUT_S = 3.0


async def ready() -> bool:
    return True


@dataclass
class Setup:
    client: httpx.AsyncClient
    searcher: SearchWithDirect
    connections: ConnectionStore
    folder_id: str
    cipher: CredentialCipher


@pytest.fixture
async def setup(runtime: Runtime, corpus: Path) -> AsyncIterator[Setup]:
    (corpus / "kafka.md").write_text("# Kafka\n\n## Retention\n\nThe orderbook topic keeps data for 9 days.\n")
    assert (await runtime.pipeline().sync(FolderConnector(corpus))).ok
    cipher = CredentialCipher([SecretStr(Fernet.generate_key().decode())])
    direct = DirectSearch(DirectConnectionStore(runtime.pool, cipher), timeout_s=TIMEOUT_S)
    searcher = SearchWithDirect(runtime.retriever, direct, CitationStore(runtime.pool))
    app = create_app(lambda: searcher, ready=ready)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            connections = ConnectionStore(runtime.pool, cipher)
            yield Setup(client, searcher, connections, FolderConnector(corpus).connection_id, cipher)
    finally:
        await searcher.aclose()


async def dingtalk_connection(setup: Setup, fake: FakeDingTalk, *, secret: str = APP_SECRET) -> str:
    credentials = {"app_key": APP_KEY, "app_secret": secret, "operator_union_id": OPERATOR}
    connection = await setup.connections.create(
        "dingtalk",
        "Team drive",
        config={"base_url": fake.base_url},
        credentials={key: SecretStr(value) for key, value in credentials.items()},
        rag_enabled=False,
    )
    return connection.id


async def yuque_connection(setup: Setup, fake: FakeYuque, *, token: str = DEFAULT_TOKEN) -> str:
    connection = await setup.connections.create(
        "yuque",
        "Handbook",
        config={"base_url": fake.base_url},
        credentials={"token": SecretStr(token)},
        rag_enabled=False,
    )
    return connection.id


async def feishu_connection(setup: Setup, fake: FakeFeishu, space_ids: list[str] | None = None) -> str:
    credentials = {"app_id": SecretStr(fake.app_id), "app_secret": SecretStr(fake.app_secret)}
    config: dict[str, Any] = {"base_url": fake.base_url, **({"space_ids": space_ids} if space_ids else {})}
    connection = await setup.connections.create(
        "feishu", "Team wiki", config=config, credentials=credentials, rag_enabled=False
    )
    return connection.id


async def ima_connection(setup: Setup, fake: FakeIma) -> str:
    credentials = {"client_id": SecretStr(DEFAULT_CLIENT_ID), "api_key": SecretStr(DEFAULT_API_KEY)}
    connection = await setup.connections.create(
        "ima", "Notes", config={"base_url": fake.base_url}, credentials=credentials, rag_enabled=False
    )
    return connection.id


async def search(setup: Setup, query: str, scope: list[str], **fields: Any) -> dict[str, Any]:
    response = await setup.client.post(
        "/v1/search", json={"query": query, "filters": {"connection_ids": scope}, **fields}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_live_hits_are_merged_with_local_results(
    setup: Setup, fake_dingtalk: FakeDingTalk, fake_yuque: FakeYuque
) -> None:
    runbook = fake_dingtalk.add("Retention runbook", "Shorten the retention before a disk fills up.")
    fake_dingtalk.add("Holiday calendar", "Nothing about the topic.")
    repo = fake_yuque.add_repo("eng/ops", "Operations")
    doc = fake_yuque.add_doc(repo, "Retention policy", "Logs keep a retention of 30 days.")
    ding, yuque = await dingtalk_connection(setup, fake_dingtalk), await yuque_connection(setup, fake_yuque)

    body = await search(setup, "retention", [setup.folder_id, ding, yuque])

    results = body["results"]
    assert body["degraded"] == []
    by_platform = {result["platform"]: result for result in results}
    assert set(by_platform) == {"folder", "dingtalk", "yuque"}
    assert by_platform["folder"]["mode"] == "rag"
    live = by_platform["dingtalk"]
    assert live["mode"] == "direct" and live["title"] == "Retention runbook"
    assert live["document_id"] == f"direct:{ding}:{runbook.uuid}" and live["url"].endswith(runbook.uuid)
    assert "Shorten the retention" in live["preview"] and live["knowledge_base"] == "Team drive"
    page = by_platform["yuque"]
    assert page["mode"] == "direct" and page["knowledge_base"] == "Operations"
    assert page["document_id"] == f"direct:{yuque}:eng/ops/{doc.id}"
    assert page["url"] == f"{fake_yuque.base_url}/eng/ops/{doc.slug}" and "<em>" not in page["text"]
    assert [result["rank"] for result in results] == list(range(1, len(results) + 1))
    assert sorted(result["citation_index"] for result in results) == list(range(1, len(results) + 1))
    assert all(left["score"] >= right["score"] for left, right in itertools.pairwise(results))


@pytest.mark.parametrize("slow", ["dingtalk", "yuque"])
async def test_a_slow_platform_is_left_out_and_listed(
    setup: Setup, fake_dingtalk: FakeDingTalk, fake_yuque: FakeYuque, slow: str
) -> None:
    fake_dingtalk.add("Retention runbook", "Shorten the retention.")
    fake_yuque.add_doc(fake_yuque.add_repo("eng/ops", "Operations"), "Retention policy", "Thirty days of retention.")
    if slow == "dingtalk":
        fake_dingtalk.search_delay_s = TIMEOUT_S + 2
    else:
        fake_yuque.search_delay_s = TIMEOUT_S + 2
    ids = {
        "dingtalk": await dingtalk_connection(setup, fake_dingtalk),
        "yuque": await yuque_connection(setup, fake_yuque),
    }

    body = await search(setup, "retention", [setup.folder_id, *ids.values()])

    (fast,) = set(ids) - {slow}
    assert {result["platform"] for result in body["results"]} == {"folder", fast}
    assert body["degraded"] == [
        {"connection_id": ids[slow], "platform": slow, "reason": f"no answer within {TIMEOUT_S:g}s"}
    ]


async def test_failing_platforms_are_degraded_with_their_reason(
    setup: Setup, fake_dingtalk: FakeDingTalk, fake_yuque: FakeYuque
) -> None:
    fake_dingtalk.add("Retention runbook", "Shorten the retention.")
    fake_dingtalk.search_failures.extend([500, 500])  # the first try and its one retry
    ding = await dingtalk_connection(setup, fake_dingtalk)
    yuque = await yuque_connection(setup, fake_yuque, token="a-revoked-token-value")

    body = await search(setup, "retention", [setup.folder_id, ding, yuque])

    assert [result["platform"] for result in body["results"]] == ["folder"]
    reasons = {entry["platform"]: entry["reason"] for entry in body["degraded"]}
    assert set(reasons) == {"dingtalk", "yuque"}
    assert "HTTP 500" in reasons["dingtalk"] and "gave up after 2 attempts" in reasons["dingtalk"]
    assert "HTTP 401" in reasons["yuque"] and "a-revoked-token-value" not in reasons["yuque"]


async def test_refused_app_credentials_degrade_without_the_secret(setup: Setup, fake_dingtalk: FakeDingTalk) -> None:
    ding = await dingtalk_connection(setup, fake_dingtalk, secret="the-wrong-app-secret")

    body = await search(setup, "retention", [setup.folder_id, ding])

    assert [result["platform"] for result in body["results"]] == ["folder"]
    (entry,) = body["degraded"]
    assert entry["connection_id"] == ding and "refused" in entry["reason"]
    assert "the-wrong-app-secret" not in entry["reason"]


async def test_citation_numbers_hold_across_searches_of_a_conversation(
    setup: Setup, fake_dingtalk: FakeDingTalk
) -> None:
    fake_dingtalk.add("Retention runbook", "Shorten the retention of the orderbook topic.")
    fake_dingtalk.add("Orderbook schema", "Fields of the orderbook.")
    ding = await dingtalk_connection(setup, fake_dingtalk)
    scope = [setup.folder_id, ding]

    first = await search(setup, "retention", scope, conversation_id="conv-direct-1")
    second = await search(setup, "orderbook retention", scope, conversation_id="conv-direct-1")

    numbers = {result["document_id"]: result["citation_index"] for result in first["results"]}
    later = {result["document_id"]: result["citation_index"] for result in second["results"]}
    assert len(later) > len(numbers) >= 2
    assert {document: later[document] for document in numbers} == numbers
    assert sorted(later.values()) == list(range(1, len(later) + 1))


async def test_private_yuque_hits_follow_the_repo_acl(setup: Setup, fake_yuque: FakeYuque) -> None:
    secret = fake_yuque.add_repo("eng/secret", "Secret", public=0)
    fake_yuque.add_doc(secret, "Retention of the vault", "Vault retention rules.", public=0)
    yuque = await yuque_connection(setup, fake_yuque)

    outsider = await search(setup, "retention", [yuque], principal={"user": "bob"})
    member = await search(setup, "retention", [yuque], principal={"user": "ada", "groups": ["yuque:eng/secret"]})

    assert outsider["results"] == [] and outsider["degraded"] == []
    assert [result["title"] for result in member["results"]] == ["Retention of the vault"]


async def test_without_live_connections_the_local_response_is_unchanged(setup: Setup) -> None:
    body = await search(setup, "orderbook retention", [setup.folder_id])

    assert body["degraded"] == [] and [result["mode"] for result in body["results"]] == ["rag"]
    assert body["results"][0]["citation_index"] == 1


async def test_grpc_answers_the_mode_and_the_degraded_platforms(
    setup: Setup, fake_dingtalk: FakeDingTalk, fake_yuque: FakeYuque
) -> None:
    fake_dingtalk.add("Retention runbook", "Shorten the retention.")
    ding = await dingtalk_connection(setup, fake_dingtalk)
    yuque = await yuque_connection(setup, fake_yuque, token="a-revoked-token-value")
    scope = retrieval_pb2.StringList(values=[setup.folder_id, ding, yuque])
    request = retrieval_pb2.SearchRequest(query="retention", filters=retrieval_pb2.SearchFilters(connection_ids=scope))

    async with (
        grpc_server(lambda: setup.searcher, host="127.0.0.1", port=0) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        answer = await retrieval_pb2_grpc.RetrievalStub(channel).Search(request, timeout=10)

    assert {(result.platform, result.mode) for result in answer.results} == {("folder", "rag"), ("dingtalk", "direct")}
    assert [(entry.connection_id, entry.platform) for entry in answer.degraded] == [(yuque, "yuque")]


async def test_ima_notes_are_searched_in_every_base(setup: Setup, fake_ima: FakeIma) -> None:
    research, ops = fake_ima.add_base("Research"), fake_ima.add_base("Ops")
    paper = fake_ima.add(research, "Retention study", "How long users keep notes: retention curves.")
    fake_ima.add(ops, "Unrelated", "Nothing to see.")
    checklist = fake_ima.add(ops, "Retention checklist", "Check the retention of every topic.")
    ima = await ima_connection(setup, fake_ima)

    body = await search(setup, "retention", [ima])

    found = {result["document_id"]: result for result in body["results"]}
    assert set(found) == {
        f"direct:{ima}:{research.kb_id}/{paper.media_id}",
        f"direct:{ima}:{ops.kb_id}/{checklist.media_id}",
    }
    assert {result["knowledge_base"] for result in found.values()} == {"Research", "Ops"}
    assert all(result["mode"] == "direct" and "<em>" not in result["preview"] for result in found.values())


async def test_new_credentials_take_effect_at_the_next_search(setup: Setup, fake_yuque: FakeYuque) -> None:
    fake_yuque.add_doc(fake_yuque.add_repo("eng/ops", "Operations"), "Retention policy", "Thirty days of retention.")
    yuque = await yuque_connection(setup, fake_yuque, token="a-token-not-yet-valid")
    refused = await search(setup, "retention", [yuque])

    await setup.connections.update(yuque, credentials={"token": SecretStr(DEFAULT_TOKEN)})
    accepted = await search(setup, "retention", [yuque])

    assert refused["results"] == [] and [entry["connection_id"] for entry in refused["degraded"]] == [yuque]
    assert [result["title"] for result in accepted["results"]] == ["Retention policy"] and accepted["degraded"] == []


async def test_hits_are_filtered_by_knowledge_base_and_metadata(setup: Setup, fake_yuque: FakeYuque) -> None:
    fake_yuque.add_doc(fake_yuque.add_repo("eng/ops", "Operations"), "Retention policy", "Thirty days of retention.")
    fake_yuque.add_doc(fake_yuque.add_repo("eng/hr", "People"), "Retention bonus", "Retention of staff.")
    yuque = await yuque_connection(setup, fake_yuque)

    people = await search(
        setup, "retention", [yuque], filters={"connection_ids": [yuque], "knowledge_bases": ["People"]}
    )
    tagged = await search(setup, "retention", [yuque], filters={"connection_ids": [yuque], "metadata": {"team": "ops"}})

    assert [result["title"] for result in people["results"]] == ["Retention bonus"]
    assert tagged["results"] == [] and tagged["degraded"] == []
    assert [path for path, _, _ in fake_yuque.requests].count("/api/v2/search") == 1  # none for the metadata filter


async def test_the_rephraser_decides_before_any_platform_is_asked(
    runtime: Runtime, setup: Setup, fake_yuque: FakeYuque, fake_dashscope: FakeDashScope
) -> None:
    """Chit-chat reaches no platform; a follow-up goes live as the same standalone question the
    local legs search."""
    repo = fake_yuque.add_repo("eng/ops", "Operations")
    fake_yuque.add_doc(repo, "Retention policy", "The trades topic keeps a retention of 30 days.")
    yuque = await yuque_connection(setup, fake_yuque)
    rephraser = DashScopeChatRephraser(fake_dashscope.api_key, base_url=f"{fake_dashscope.base_url}/compatible-mode/v1")
    retriever = HybridRetriever(
        SearchStore(runtime.pool), runtime.embedder, CitationStore(runtime.pool), rephraser=rephraser
    )
    direct = DirectSearch(DirectConnectionStore(runtime.pool, setup.cipher), timeout_s=TIMEOUT_S)
    searcher = SearchWithDirect(retriever, direct, CitationStore(runtime.pool))
    scope = SearchFilters(connection_ids=[setup.folder_id, yuque])
    history = [ChatTurn(role="user", content="What is the retention for the orderbook topic?")]
    try:
        chat = await searcher.search(SearchRequest(query="Hello!", history=history, filters=scope))
        assert (chat.rephrase_outcome, chat.results) == ("chitchat", [])
        assert not [path for path, _, _ in fake_yuque.requests if path == "/api/v2/search"]

        follow_up = await searcher.search(
            SearchRequest(query="And for the trades topic?", history=history, filters=scope)
        )
    finally:
        await searcher.aclose()
        await rephraser.aclose()

    standalone = "What is the retention for the trades topic?"
    assert (follow_up.rephrase_outcome, follow_up.rewritten_query) == ("rephrased", standalone)
    asked = [query["q"] for path, query, _ in fake_yuque.requests if path == "/api/v2/search"]
    assert asked == [standalone]
    assert any(result.mode == "direct" for result in follow_up.results)


async def test_feishu_is_searched_live_with_the_apps_token_through_unified_search(
    setup: Setup, fake_feishu: FakeFeishu
) -> None:
    garden, kitchen = fake_feishu.add_space("Garden"), fake_feishu.add_space("Kitchen")
    fake_feishu.add_node(garden, "Retention of seeds", "# Seeds\n\nSeeds keep a retention of two years when dry.\n")
    fake_feishu.add_node(kitchen, "Retention of soup", "# Soup\n\nSoup keeps three days.\n")
    everything = await feishu_connection(setup, fake_feishu)
    gardens_only = await feishu_connection(setup, fake_feishu, [garden.space_id])

    body = await search(setup, "retention", [setup.folder_id, everything])
    live = [result for result in body["results"] if result["mode"] == "direct"]
    assert body["degraded"] == [] and {result["title"] for result in live} == {
        "Retention of seeds",
        "Retention of soup",
    }
    seeds = next(result for result in live if result["title"] == "Retention of seeds")
    assert seeds["platform"] == "feishu" and "<h>" not in seeds["text"] and "retention of two years" in seeds["text"]
    assert seeds["url"].startswith("https://fake.feishu.cn/wiki/")

    scoped = await search(setup, "retention", [gardens_only])
    assert [result["title"] for result in scoped["results"]] == ["Retention of seeds"]

    # Unified search refuses queries over 30 characters: the searcher sends the first 30.
    cut = await search(setup, "retention of two years when dry, stored in a cool cellar", [gardens_only])
    assert cut["degraded"] == [] and [result["title"] for result in cut["results"]] == ["Retention of seeds"]


async def test_a_feishu_search_the_platform_refuses_degrades_without_the_secret(
    setup: Setup, fake_feishu: FakeFeishu
) -> None:
    connection = await feishu_connection(setup, fake_feishu)
    fake_feishu.fail_next(5, path="/open-apis/search/", status=400, code=99991672)

    body = await search(setup, "retention", [setup.folder_id, connection])

    (degraded,) = body["degraded"]
    assert degraded["platform"] == "feishu" and "99991672" in degraded["reason"]
    assert fake_feishu.app_secret not in degraded["reason"]
    assert body["results"] and all(result["mode"] == "rag" for result in body["results"])
