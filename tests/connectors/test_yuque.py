"""The Yuque connector against the fake Yuque over real HTTP: repos, paging, TOC paths, bodies, ACL,
throttling and errors, then syncs through the embedded pipeline."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from pydantic import SecretStr

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.connectors.registry import ConnectionRow, NoConnector, connector_for
from ragstream.connectors.yuque import USER_AGENT, YuqueAuthError, YuqueClient, YuqueConfig, YuqueConnector
from ragstream.credentials import CredentialCipher
from ragstream.retrieval import Principal, SearchFilters, SearchRequest
from ragstream.runtime import Runtime
from ragstream.storage.connections import ConnectionStore
from ragstream.vendor_http import RetryPolicy

pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_yuque import FakeDoc, FakeRepo, FakeYuque

pytest_plugins = ["tests.support.fake_yuque"]

FAST = RetryPolicy(max_retries=3, backoff_initial_s=0.001, backoff_max_s=0.005)

MakeConnector = Callable[..., YuqueConnector]


@pytest.fixture
async def make_connector(fake_yuque: FakeYuque) -> AsyncIterator[MakeConnector]:
    """Connectors pointed at the fake, each under a new connection id, closed after the test."""
    made: list[YuqueConnector] = []

    def make(*, token: str | None = None, settings: dict[str, Any] | None = None, **client: Any) -> YuqueConnector:
        yuque = YuqueClient(SecretStr(token or fake_yuque.token), base_url=fake_yuque.base_url, retry=FAST, **client)
        config = YuqueConfig.model_validate({"base_url": fake_yuque.base_url, **(settings or {})})
        connector = YuqueConnector(f"yuque-{uuid.uuid4().hex[:8]}", "Team docs", yuque, config)
        made.append(connector)
        return connector

    yield make
    for connector in made:
        await connector.aclose()


async def listed(connector: YuqueConnector) -> list[SourceItem]:
    return [item async for item in connector.list_items()]


def books(fake: FakeYuque) -> tuple[FakeRepo, dict[str, FakeDoc]]:
    """A public group repo with a TOC group, a nested doc and a private doc; the user's own repo."""
    repo = fake.add_repo("eng/handbook", "Engineering handbook")
    ops = fake.add_title(repo, "Operations")
    docs = {"deploy": fake.add_doc(repo, "Deployments", "## Rollout\n\nThe brackenfell rollout starts on Thursday.\n")}
    docs["oncall"] = fake.add_doc(
        repo, "On-call", "## Paging\n\nPage the thimbleweed rota first.\n", parent=f"d{docs['deploy'].id}"
    )
    docs["deploy"].parent_uuid = ops
    docs["secret"] = fake.add_doc(repo, "Salaries", "The quillwort salary bands are private.\n", public=0)
    own = fake.add_repo("ada/notes", "Ada's notes")
    docs["budget"] = fake.add_doc(own, "Budget", "The larkspur budget closes in March.\n")
    return repo, docs


async def test_listing_walks_the_users_and_groups_repos_in_ascending_id_order(
    fake_yuque: FakeYuque, make_connector: MakeConnector
) -> None:
    _, docs = books(fake_yuque)
    big = fake_yuque.add_repo("eng/big", "Big book")
    for number in range(130):
        fake_yuque.add_doc(big, f"Page {number}", f"text {number}\n")
    fake_yuque.add_doc(fake_yuque.add_repo("other/closed", "Not ours"), "Elsewhere", "text\n")

    items = await listed(make_connector())

    ids = [item.external_id for item in items]
    assert ids == sorted(ids) and len(ids) == len(set(ids)) == 130 + 4
    assert not any(item.external_id.startswith("other/") for item in items)  # a group the user is not in
    pages = [query for path, query, _ in fake_yuque.requests if path == "/api/v2/repos/eng/big/docs"]
    assert [(query["offset"], query["limit"]) for query in pages] == [("0", "100"), ("100", "100")]
    assert all(
        headers.get("x-auth-token") == fake_yuque.token and headers.get("user-agent") == USER_AGENT
        for _, _, headers in fake_yuque.requests
    )
    assert fake_yuque.content_requests() == []  # the listing reads no content

    by_title = {item.metadata["slug"]: item for item in items}
    oncall = by_title[docs["oncall"].slug]
    assert oncall.external_id == f"eng/handbook/{docs['oncall'].id}"
    assert (oncall.title, oncall.knowledge_base) == ("Operations > Deployments > On-call", "Engineering handbook")
    assert oncall.url == f"{fake_yuque.base_url}/eng/handbook/{docs['oncall'].slug}"
    assert oncall.source_version == f"{docs['oncall'].stamp()}|Operations > Deployments > On-call"
    assert oncall.acl is None
    assert by_title[docs["secret"].slug].acl == ("group:yuque:eng/handbook",)  # private (public 0)
    assert by_title[docs["budget"].slug].title == "Budget"  # outside any TOC group
    text = (await make_connector().fetch(oncall)).decode()
    assert text.startswith("# Operations > Deployments > On-call\n\n## Paging")
    assert fake_yuque.content_requests() == [f"eng/handbook/{docs['oncall'].id}"]


async def test_configured_repos_private_repos_and_body_fallbacks(
    fake_yuque: FakeYuque, make_connector: MakeConnector
) -> None:
    books(fake_yuque)
    private = fake_yuque.add_repo("eng/private", "Private book", public=0)
    html = fake_yuque.add_doc(private, "From HTML", body_html="<h2>Setup</h2><p>The <b>marigold</b> setup.</p>")
    lake = fake_yuque.add_doc(private, "From lake", format="lake", body_lake="<!doctype lake><p>The yarrow plan.</p>")
    connector = make_connector(settings={"repos": ["eng/private"]})
    items = {item.title: item for item in await listed(connector)}
    assert set(items) == {"From HTML", "From lake"}
    assert all(item.acl == ("group:yuque:eng/private",) for item in items.values())  # a private repo's docs
    assert "/api/v2/user" not in [path for path, _, _ in fake_yuque.requests]
    assert (await connector.fetch(items["From HTML"])).decode() == "# From HTML\n\n## Setup\n\nThe **marigold** setup."
    assert "The yarrow plan." in (await connector.fetch(items["From lake"])).decode()
    assert {html.id, lake.id} == {int(item.metadata["doc_id"]) for item in items.values()}

    with pytest.raises(Exception, match="404"):
        await listed(make_connector(settings={"repos": ["eng/missing"]}))  # a repo that cannot be listed

    for number in range(120):
        fake_yuque.add_doc(private, f"Page {number}", f"text {number}\n")
    fake_yuque.ignore_offset = True  # the same first page for every offset: the walk must stop, not loop
    with pytest.raises(Exception, match="offset 100 answered the previous page again"):
        await listed(connector)


async def test_an_enterprise_host_gets_the_same_api_path() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"data": {"id": 7, "login": "ada"}})

    client = YuqueClient(SecretStr("t"), base_url="https://acme.yuque.com/", transport=httpx.MockTransport(answer))
    try:
        assert (await client.user())["login"] == "ada"
    finally:
        await client.aclose()
    assert str(seen[0].url) == "https://acme.yuque.com/api/v2/user"
    assert seen[0].headers["user-agent"] == USER_AGENT and seen[0].headers["x-auth-token"] == "t"


async def test_a_429_is_waited_out_as_the_headers_say(fake_yuque: FakeYuque, make_connector: MakeConnector) -> None:
    _, docs = books(fake_yuque)
    connector = make_connector()
    item = next(item for item in await listed(connector) if item.metadata["slug"] == docs["deploy"].slug)

    fake_yuque.throttle_next(2, reset_s=1)
    started = time.monotonic()
    assert b"brackenfell" in await connector.fetch(item)
    assert time.monotonic() - started >= 1.9  # X-RateLimit-Reset waited out twice, not the 1 ms backoff
    assert fake_yuque.content_requests() == [f"eng/handbook/{docs['deploy'].id}"] * 3
    assert fake_yuque.rate_limited == 2


async def test_errors_per_document_and_for_the_whole_connection(
    fake_yuque: FakeYuque, make_connector: MakeConnector, caplog: pytest.LogCaptureFixture
) -> None:
    repo, docs = books(fake_yuque)
    connector = make_connector()
    items = {item.metadata["slug"]: item for item in await listed(connector)}

    docs["oncall"].denied = True
    with pytest.raises(DocumentUnreadable) as denied:
        await connector.fetch(items[docs["oncall"].slug])
    assert (denied.value.code, denied.value.retryable) == ("permission_denied", False)
    assert "HTTP 403" in denied.value.message

    fake_yuque.delete(repo, docs["deploy"])
    with pytest.raises(DocumentVanished):
        await connector.fetch(items[docs["deploy"].slug])

    wrong = "wrong-" + uuid.uuid4().hex
    with pytest.raises(YuqueAuthError) as refused:
        await listed(make_connector(token=wrong))
    assert "HTTP 401" in str(refused.value) and refused.value.__cause__ is None
    assert wrong not in caplog.text


def test_the_registry_builds_it_from_a_connection_without_showing_secrets(fake_yuque: FakeYuque) -> None:
    token = SecretStr("yq-PLANTED-" + uuid.uuid4().hex)
    config = {"base_url": fake_yuque.base_url, "repos": ["eng/handbook"]}
    row = ConnectionRow("conn-1", "yuque", "Docs", config, {"token": token})
    connector = connector_for(row)
    assert isinstance(connector, YuqueConnector) and connector.settings.repos == ["eng/handbook"]
    assert token.get_secret_value() not in repr(row)
    with pytest.raises(NoConnector, match="needs credentials token"):
        connector_for(ConnectionRow("conn-2", "yuque", "Docs", {}, {}))
    with pytest.raises(NoConnector, match=r"invalid config \(repos\)"):
        connector_for(ConnectionRow("conn-3", "yuque", "Docs", {"repos": ["no-slash"]}, row.credentials))


# -- through the embedded pipeline --------------------------------------------------------------


@pytest.fixture
async def cleanup(runtime: Runtime) -> AsyncIterator[list[str]]:
    """Connection ids to delete after the test with everything they indexed."""
    ids: list[str] = []
    yield ids
    store = ConnectionStore(runtime.pool, CredentialCipher([]))
    for connection_id in ids:
        await store.delete(connection_id)


async def search(runtime: Runtime, connection_id: str, query: str, *groups: str) -> list[Any]:
    """Results whose text holds the query's first word (the vector leg always returns neighbours)."""
    principal = Principal(user="someone", groups=list(groups)) if groups else None
    response = await runtime.retriever.search(
        SearchRequest(query=query, filters=SearchFilters(connection_ids=[connection_id]), principal=principal)
    )
    term = query.split()[0].lower()
    return [result for result in response.results if term in result.text.lower()]


@pytest.mark.integration
async def test_sync_indexes_edits_and_deletes_with_a_denied_document_failing_alone(
    runtime: Runtime, fake_yuque: FakeYuque, make_connector: MakeConnector, cleanup: list[str]
) -> None:
    _, docs = books(fake_yuque)
    docs["oncall"].denied = True
    connector = make_connector()
    cleanup.append(connector.connection_id)

    first = await runtime.pipeline().sync(connector)
    assert [(failure.step, failure.code) for failure in first.failures] == [("fetch", "permission_denied")]
    assert (first.progress.listed, first.progress.indexed) == (4, 3)
    [hit] = await search(runtime, connector.connection_id, "brackenfell rollout")
    assert (hit.title, hit.knowledge_base, hit.platform) == (
        "Operations > Deployments",
        "Engineering handbook",
        "yuque",
    )
    assert "Operations > Deployments" in hit.heading
    assert not await search(runtime, connector.connection_id, "quillwort salary")  # private: needs the group
    assert await search(runtime, connector.connection_id, "quillwort salary", "yuque:eng/handbook")

    fake_yuque.requests.clear()
    again = await runtime.pipeline().sync(connector)
    assert (again.progress.unchanged, again.progress.indexed) == (3, 0)
    assert fake_yuque.content_requests() == [f"eng/handbook/{docs['oncall'].id}"]  # only the failed one again

    fake_yuque.edit(docs["deploy"], "## Rollout\n\nThe glimmerwort rollout moved to Mondays.\n")
    fake_yuque.delete(fake_yuque.repos["ada/notes"], docs["budget"])
    docs["oncall"].denied = False
    fake_yuque.requests.clear()
    edited = await runtime.pipeline().sync(connector)
    assert edited.ok, edited.failures
    assert sorted(fake_yuque.content_requests()) == sorted(
        [f"eng/handbook/{docs['deploy'].id}", f"eng/handbook/{docs['oncall'].id}"]
    )
    assert (edited.progress.indexed, edited.progress.deleted, edited.progress.unchanged) == (2, 1, 1)
    assert await search(runtime, connector.connection_id, "glimmerwort rollout")
    assert not await search(runtime, connector.connection_id, "brackenfell rollout")
    assert not await search(runtime, connector.connection_id, "larkspur budget")
    assert await search(runtime, connector.connection_id, "thimbleweed rota")

    fake_yuque.requests.clear()
    unchanged = await runtime.pipeline().sync(connector)
    assert unchanged.ok and unchanged.progress.unchanged == 3
    assert fake_yuque.content_requests() == []  # nothing changed: nothing downloaded
