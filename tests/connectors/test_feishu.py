"""The Feishu wiki connector against the fake Feishu over real HTTP: pagination and order, the tenant
token, throttling and errors, then syncs through the embedded pipeline and the connections API."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream.api.auth import Access
from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.connectors.feishu import (
    LARK_BASE_URL,
    FeishuAuthError,
    FeishuClient,
    FeishuConfig,
    FeishuConnector,
    FeishuLimits,
    FeishuRetry,
    RateLimit,
)
from ragstream.connectors.registry import ConnectionRow, NoConnector, connector_for
from ragstream.credentials import CredentialCipher
from ragstream.embedded import serve
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings
from ragstream.storage.connections import ConnectionStore
from ragstream_fetcher import main as fetcher_main
from tests.support.connections import fetcher_database, private_database

# The fake vendors listen on 127.0.0.1.
pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_feishu import FakeFeishu, FakeNode, FakeSpace

pytest_plugins = ["tests.support.fake_feishu"]

# Millisecond backoffs keep the retry tests fast while still going through tenacity.
FAST = FeishuRetry(max_retries=3, backoff_initial_s=0.001, backoff_max_s=0.005)

MakeConnector = Callable[..., FeishuConnector]


@pytest.fixture
async def make_connector(fake_feishu: FakeFeishu) -> AsyncIterator[MakeConnector]:
    """Connectors pointed at the fake, each under a new connection id, closed after the test."""
    made: list[FeishuConnector] = []

    def make(
        *, secret: str | None = None, retry: FeishuRetry = FAST, settings: dict[str, Any] | None = None, **client: Any
    ) -> FeishuConnector:
        feishu = FeishuClient(
            fake_feishu.app_id,
            SecretStr(secret or fake_feishu.app_secret),
            base_url=fake_feishu.base_url,
            retry=retry,
            **client,
        )
        config = FeishuConfig.model_validate({"base_url": fake_feishu.base_url, **(settings or {})})
        connector = FeishuConnector(f"feishu-{uuid.uuid4().hex[:8]}", "Team wiki", feishu, config)
        made.append(connector)
        return connector

    yield make
    for connector in made:
        await connector.aclose()


async def listed(connector: FeishuConnector) -> list[SourceItem]:
    return [item async for item in connector.list_items()]


def tree(fake: FakeFeishu) -> tuple[FakeSpace, dict[str, FakeNode]]:
    """A space with documents under a root page, a sheet holding a docx child, and a shortcut."""
    space = fake.add_space("Engineering")
    root = fake.add_node(space, "Handbook", "# Handbook\n\nWelcome to the quillwort handbook.\n")
    nodes = {
        "root": root,
        "deploy": fake.add_node(
            space,
            "Deployments",
            "# Deployments\n\n## Rollout\n\nThe brackenfell rollout starts every Thursday at 09:30.\n",
            parent=root,
        ),
        "oncall": fake.add_node(
            space, "On-call", "# On-call\n\n## Paging\n\nPage the thimbleweed rota first.\n", parent=root
        ),
        "sheet": fake.add_node(space, "Budget", obj_type="sheet"),
    }
    nodes["under_sheet"] = fake.add_node(
        space, "Budget notes", "# Budget notes\n\nThe larkspur budget closes in March.\n", parent=nodes["sheet"]
    )
    nodes["shortcut"] = fake.add_node(space, "Handbook link", "", node_type="shortcut")
    return space, nodes


# -- the client against the fake ---------------------------------------------------------------


async def test_listing_pages_through_every_space_and_tree_in_ascending_id_order(
    fake_feishu: FakeFeishu, make_connector: MakeConnector
) -> None:
    fake_feishu.empty_first_pages = True  # a page may be empty while has_more is true
    big = fake_feishu.add_space("Big space")
    parent = fake_feishu.add_node(big, "Index", "# Index\n\ntext\n")
    for number in range(120):
        fake_feishu.add_node(big, f"Page {number}", f"# Page {number}\n\ntext {number}\n", parent=parent)
    small, nodes = tree(fake_feishu)
    fake_feishu.add_space("Not a member", member=False)

    items = await listed(make_connector())

    ids = [item.external_id for item in items]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    docx = {node.node_token for space in (big, small) for node in space.nodes.values() if node.obj_type == "docx"}
    docx -= {nodes["shortcut"].node_token}
    assert {item.metadata["node_token"] for item in items} == docx  # no sheet, no shortcut, nested docx kept
    assert len(items) == 121 + 4
    children = [
        query for _, path, query in fake_feishu.requests if path.endswith("/nodes") and "parent_node_token" in query
    ]
    # 120 children at 50 a page: an empty first page, then 3 pages, each asked for with its page_token.
    big_pages = [query for query in children if query["parent_node_token"] == parent.node_token]
    assert len(big_pages) == 4 and all(query["page_size"] == "50" for query in big_pages)
    assert sum("page_token" in query for query in big_pages) == 3

    item = next(item for item in items if item.metadata["node_token"] == nodes["deploy"].node_token)
    assert item.external_id == f"{small.space_id}/{nodes['deploy'].node_token}"
    assert (item.title, item.knowledge_base, item.media_type) == ("Deployments", "Engineering", "text/markdown")
    assert item.url == item.source == f"https://www.feishu.cn/wiki/{nodes['deploy'].node_token}"
    assert item.source_version == f"markdown:{nodes['deploy'].obj_edit_time}"
    assert item.acl is None
    assert item.metadata["obj_token"] == nodes["deploy"].obj_token and item.metadata["owner"] == "ou_fakeowner"
    assert b"brackenfell rollout" in await make_connector().fetch(item)


async def test_configured_spaces_only(fake_feishu: FakeFeishu, make_connector: MakeConnector) -> None:
    wanted, _ = tree(fake_feishu)
    other = fake_feishu.add_space("Other")
    fake_feishu.add_node(other, "Elsewhere", "# Elsewhere\n\ntext\n")
    items = await listed(make_connector(settings={"space_ids": [wanted.space_id], "web_url": "https://acme.feishu.cn"}))
    assert {item.metadata["space_id"] for item in items} == {wanted.space_id}
    assert all(item.url and item.url.startswith("https://acme.feishu.cn/wiki/") for item in items)
    assert "/open-apis/wiki/v2/spaces" not in fake_feishu.paths()  # no listing of all spaces

    gone = make_connector(settings={"space_ids": [fake_feishu.add_space("Closed", member=False).space_id]})
    with pytest.raises(Exception, match="131006"):
        await listed(gone)  # a space that cannot be listed fails the sync: nothing may be deleted for it


async def test_the_token_is_cached_and_fetched_again_when_it_expires(
    fake_feishu: FakeFeishu, make_connector: MakeConnector
) -> None:
    tree(fake_feishu)
    connector = make_connector()
    assert len(await listed(connector)) == 4
    assert len(await listed(connector)) == 4
    assert fake_feishu.token_requests == 1  # one token for every call while it lives

    fake_feishu.expire_tokens()  # the platform answers 99991663: a new token, and the call again
    assert len(await listed(connector)) == 4
    assert fake_feishu.token_requests == 2

    fake_feishu.expire_tokens()  # else the 30-minute rule hands out the long-lived token again
    fake_feishu.token_lifetime_s = 1.0
    short = make_connector(token_refresh_margin_s=0.0)
    await listed(short)
    before = fake_feishu.token_requests
    await asyncio.sleep(1.1)  # the cached token's lifetime has run out: the client asks before calling
    await listed(short)
    assert fake_feishu.token_requests == before + 1


async def test_throttling_is_retried_after_the_platform_says(
    fake_feishu: FakeFeishu, make_connector: MakeConnector
) -> None:
    _, nodes = tree(fake_feishu)
    connector = make_connector()
    item = next(item for item in await listed(connector) if item.title == "Deployments")

    fake_feishu.throttle_next(2, path="/open-apis/docs/v1/content", reset_s=1)
    started = time.monotonic()
    assert b"brackenfell" in await connector.fetch(item)
    assert time.monotonic() - started >= 1.9  # x-ogw-ratelimit-reset waited out twice, not the 1 ms backoff
    assert fake_feishu.content_requests() == [nodes["deploy"].obj_token] * 3

    # The fake's own window, tighter than the client's pacing: its 429s are absorbed the same way.
    fake_feishu.limits["content"] = (2, 1.0)
    fast = make_connector(limits=FeishuLimits(content=RateLimit(100, 1.0)))
    items = await listed(fast)
    assert all([await fast.fetch(each) for each in items])
    assert fake_feishu.rate_limited > 0


async def test_the_client_paces_itself_within_the_documented_window(
    fake_feishu: FakeFeishu, make_connector: MakeConnector
) -> None:
    tree(fake_feishu)
    connector = make_connector()  # the documented 5/s for content
    items = await listed(connector)
    started = time.monotonic()
    for _ in range(2):
        for item in items:
            await connector.fetch(item)
    assert time.monotonic() - started >= 1.1  # 8 reads at 5 a second, with the client's 20% margin
    assert fake_feishu.rate_limited == 0


async def test_errors_per_document_and_for_the_whole_app(
    fake_feishu: FakeFeishu, make_connector: MakeConnector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _, nodes = tree(fake_feishu)
    connector = make_connector()
    items = {item.title: item for item in await listed(connector)}

    nodes["oncall"].denied = True
    with pytest.raises(DocumentUnreadable) as denied:
        await connector.fetch(items["On-call"])
    assert (denied.value.code, denied.value.retryable) == ("permission_denied", False)
    assert "1770032" in denied.value.message

    fake_feishu.delete(nodes["deploy"])
    with pytest.raises(DocumentVanished):
        await connector.fetch(items["Deployments"])

    fake_feishu.fail_next(10, path="/open-apis/docs/v1/content")
    with pytest.raises(DocumentUnreadable) as unavailable:
        await connector.fetch(items["Handbook"])
    assert (unavailable.value.code, unavailable.value.retryable) == ("platform_unavailable", True)
    assert "gave up after 4 attempts" in unavailable.value.message

    secret = "wrong-" + uuid.uuid4().hex
    fake_feishu.echo_secret_in_errors = True
    with pytest.raises(FeishuAuthError) as auth:
        await listed(make_connector(secret=secret))
    assert "10014" in str(auth.value) and "app secret invalid: ***" in str(auth.value)
    assert secret not in repr(auth.value) and auth.value.__cause__ is None
    assert secret not in caplog.text and fake_feishu.app_secret not in caplog.text


async def test_plain_text_reads_raw_content(fake_feishu: FakeFeishu, make_connector: MakeConnector) -> None:
    _, nodes = tree(fake_feishu)
    connector = make_connector(settings={"content_format": "plain"})
    item = next(item for item in await listed(connector) if item.title == "Deployments")
    assert item.media_type == "text/plain" and item.source_version == f"plain:{nodes['deploy'].obj_edit_time}"
    assert (await connector.fetch(item)).startswith(b"Deployments\n")
    assert fake_feishu.paths("/open-apis/docx/v1/documents/") == [
        f"/open-apis/docx/v1/documents/{nodes['deploy'].obj_token}/raw_content"
    ]


def test_the_registry_builds_it_from_a_connection_without_showing_secrets(fake_feishu: FakeFeishu) -> None:
    secret = SecretStr("sk-PLANTED-" + uuid.uuid4().hex)
    row = ConnectionRow(
        "conn-1",
        "feishu",
        "Wiki",
        {"base_url": fake_feishu.base_url},
        {"app_id": SecretStr("cli_1"), "app_secret": secret},
    )
    connector = connector_for(row)
    assert isinstance(connector, FeishuConnector) and connector.name == "Wiki"
    assert secret.get_secret_value() not in repr(row)
    lark = connector_for(ConnectionRow("conn-4", "lark", "Wiki", {"space_ids": [7012]}, row.credentials))
    assert isinstance(lark, FeishuConnector) and lark.platform == "lark"
    assert lark.settings.base_url == LARK_BASE_URL and lark.settings.space_ids == ["7012"]
    assert lark.settings.link_base() == "https://www.larksuite.com"
    with pytest.raises(NoConnector, match="needs credentials app_secret"):
        connector_for(ConnectionRow("conn-2", "feishu", "Wiki", {}, {"app_id": SecretStr("cli_1")}))
    with pytest.raises(NoConnector, match=r"invalid config \(content_format\)"):
        connector_for(ConnectionRow("conn-3", "feishu", "Wiki", {"content_format": "pdf"}, row.credentials))


# -- through the embedded pipeline --------------------------------------------------------------


@pytest.fixture
async def cleanup(runtime: Runtime) -> AsyncIterator[list[str]]:
    """Connection ids to delete after the test with everything they indexed, so the corpus statistics
    other tests rank by stay as they were."""
    ids: list[str] = []
    yield ids
    store = ConnectionStore(runtime.pool, CredentialCipher([]))
    for connection_id in ids:
        await store.delete(connection_id)


async def search(runtime: Runtime, connection_id: str, query: str) -> list[Any]:
    """Results whose text holds the query's first word (the vector leg always returns neighbours)."""
    response = await runtime.retriever.search(
        SearchRequest(query=query, filters=SearchFilters(connection_ids=[connection_id]))
    )
    term = query.split()[0].lower()
    return [result for result in response.results if term in result.text.lower()]


@pytest.mark.integration
async def test_sync_indexes_edits_and_deletes_with_a_denied_document_failing_alone(
    runtime: Runtime,
    fake_feishu: FakeFeishu,
    make_connector: MakeConnector,
    cleanup: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    _, nodes = tree(fake_feishu)
    nodes["oncall"].denied = True
    connector = make_connector()
    cleanup.append(connector.connection_id)

    first = await runtime.pipeline().sync(connector)
    assert [(failure.step, failure.code) for failure in first.failures] == [("fetch", "permission_denied")]
    assert first.failures[0].source.endswith(nodes["oncall"].node_token)
    assert (first.progress.listed, first.progress.indexed) == (4, 3)
    [hit] = await search(runtime, connector.connection_id, "brackenfell rollout")
    assert (hit.title, hit.knowledge_base, hit.platform) == ("Deployments", "Engineering", "feishu")
    assert hit.url == f"https://www.feishu.cn/wiki/{nodes['deploy'].node_token}" and "Deployments" in hit.heading
    assert await search(runtime, connector.connection_id, "larkspur budget")  # under a sheet, still indexed

    fake_feishu.requests.clear()
    again = await runtime.pipeline().sync(connector)
    assert (again.progress.unchanged, again.progress.indexed) == (3, 0)
    assert fake_feishu.content_requests() == [nodes["oncall"].obj_token]  # only the failed one is tried again

    fake_feishu.edit(nodes["deploy"], "# Deployments\n\n## Rollout\n\nThe glimmerwort rollout moved to Mondays.\n")
    fake_feishu.delete(nodes["under_sheet"])
    nodes["oncall"].denied = False
    fake_feishu.requests.clear()
    edited = await runtime.pipeline().sync(connector)
    assert edited.ok, edited.failures
    assert sorted(fake_feishu.content_requests()) == sorted([nodes["deploy"].obj_token, nodes["oncall"].obj_token])
    assert (edited.progress.indexed, edited.progress.deleted, edited.progress.unchanged) == (2, 1, 1)
    assert await search(runtime, connector.connection_id, "glimmerwort rollout")
    assert not await search(runtime, connector.connection_id, "brackenfell rollout")
    assert not await search(runtime, connector.connection_id, "larkspur budget")
    assert await search(runtime, connector.connection_id, "thimbleweed rota")
    assert "out of ascending id order" not in caplog.text  # the download cursor was usable throughout


# -- through the connections API and a sync run -------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.integration
async def test_a_connection_made_over_the_api_syncs_to_ready_and_is_searchable(
    database_url: str, fake_feishu: FakeFeishu, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    space, nodes = tree(fake_feishu)
    settings = Settings(
        database_url=database_url,
        credential_keys=SecretStr(Fernet.generate_key().decode()),
        scheduler_enabled=False,
        sync_progress_interval_s=0.2,
    )
    port = free_port()
    async with private_database(database_url) as dsn, open_runtime(settings, dsn) as runtime:
        server = asyncio.create_task(serve(runtime, [], "127.0.0.1", port, 0, grpc_port=0, access=Access.open()))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for _ in range(200):
                    try:
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                body = {
                    "platform": "feishu",
                    "name": "Team wiki",
                    "config": {
                        "base_url": fake_feishu.base_url,
                        "space_ids": [space.space_id],
                        "web_url": "https://acme.feishu.cn",
                    },
                    "credentials": {"app_id": fake_feishu.app_id, "app_secret": fake_feishu.app_secret},
                }
                created = await client.post("/v1/connections", json=body)
                assert created.status_code == 201, created.text
                connection_id = created.json()["id"]
                status: dict[str, Any] = {}
                for _ in range(600):
                    status = (await client.get(f"/v1/connections/{connection_id}/status")).json()
                    if status["status"] in ("Ready", "Failed"):
                        break
                    await asyncio.sleep(0.1)
                assert status["status"] == "Ready", status
                assert status["progress"]["indexed"] == 4

                found = await client.post(
                    "/v1/search",
                    json={"query": "brackenfell rollout Thursday", "filters": {"connection_ids": [connection_id]}},
                )
                assert found.status_code == 200, found.text
                top = found.json()["results"][0]
                assert "brackenfell rollout" in top["text"]
                assert top["url"] == f"https://acme.feishu.cn/wiki/{nodes['deploy'].node_token}"
                assert (top["knowledge_base"], top["title"], top["platform"]) == (
                    "Engineering",
                    "Deployments",
                    "feishu",
                )
                assert fake_feishu.app_secret not in created.text
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
    assert fake_feishu.app_secret not in caplog.text


@pytest.mark.integration
@pytest.mark.kafka
async def test_the_fetcher_service_syncs_a_feishu_connection_with_its_stored_credentials(
    database_url: str, kafka_bootstrap: str, fake_feishu: FakeFeishu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distributed mode: the scheduler enqueues the new connection, the fetcher claims it, decrypts its
    credentials for the connector and stages every page (no chunker runs here, so they stay staged)."""
    space, nodes = tree(fake_feishu)
    key = Fernet.generate_key().decode()
    async with fetcher_database(
        database_url,
        kafka_bootstrap,
        monkeypatch,
        scheduler_enabled="true",
        scheduler_interval_s="0.2",
        sync_progress_interval_s="0.1",
        credential_keys=key,
    ) as pool:
        app = fetcher_main.create_app()
        async with app.router.lifespan_context(app):
            made = await ConnectionStore(pool, CredentialCipher([SecretStr(key)])).create(
                "feishu",
                "Team wiki",
                config={"base_url": fake_feishu.base_url, "space_ids": [space.space_id]},
                credentials={"app_id": SecretStr(fake_feishu.app_id), "app_secret": SecretStr(fake_feishu.app_secret)},
            )
            deadline = time.monotonic() + 60
            staged = 0
            while staged < 4:
                failed = await pool.fetchval(
                    "SELECT error FROM runs WHERE connection_id = $1 AND status = 'failed'", made.id
                )
                assert failed is None, failed
                assert time.monotonic() < deadline, "the fetcher did not stage the Feishu pages"
                await asyncio.sleep(0.1)
                staged = await pool.fetchval("SELECT count(*) FROM staged_documents WHERE connection_id = $1", made.id)
    documents = [node.obj_token for node in nodes.values() if node.obj_type == "docx" and node.node_type == "origin"]
    assert sorted(fake_feishu.content_requests()) == sorted(documents)
