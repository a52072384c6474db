"""The IMA connector against the fake IMA over real HTTP: bases, cursor lists and folders, notes only,
the export cap and 110021, permission errors and the negative cache, then syncs through the embedded
pipeline."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import SecretStr

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.connectors.ima import ImaAuthError, ImaClient, ImaConfig, ImaConnector, ImaLimits, NegativeCache
from ragstream.connectors.registry import ConnectionRow, NoConnector, connector_for
from ragstream.credentials import CredentialCipher
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import Runtime
from ragstream.storage.connections import ConnectionStore
from ragstream.vendor_http import RateLimit, RetryPolicy

pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_ima import FakeBase, FakeIma, FakeMedia

pytest_plugins = ["tests.support.fake_ima"]

FAST = RetryPolicy(max_retries=3, backoff_initial_s=0.001, backoff_max_s=0.005)

MakeConnector = Callable[..., ImaConnector]


class Clock:
    """The negative cache's time, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def make_connector(fake_ima: FakeIma, clock: Clock) -> AsyncIterator[MakeConnector]:
    """Connectors pointed at the fake, each under a new connection id and with its own five-minute
    negative cache on ``clock``, closed after the test."""
    made: list[ImaConnector] = []

    def make(*, api_key: str | None = None, settings: dict[str, Any] | None = None, **client: Any) -> ImaConnector:
        options: dict[str, Any] = {"retry": FAST, "throttled_wait_s": 0.01, **client}
        ima = ImaClient(
            SecretStr(fake_ima.client_id), SecretStr(api_key or fake_ima.api_key), base_url=fake_ima.base_url, **options
        )
        config = ImaConfig.model_validate({"base_url": fake_ima.base_url, **(settings or {})})
        connector = ImaConnector(
            f"ima-{uuid.uuid4().hex[:8]}", "Notes", ima, config, unreadable=NegativeCache(300.0, clock=clock)
        )
        made.append(connector)
        return connector

    yield make
    for connector in made:
        await connector.aclose()


async def listed(connector: ImaConnector) -> list[SourceItem]:
    return [item async for item in connector.list_items()]


def library(fake: FakeIma) -> tuple[FakeBase, dict[str, FakeMedia]]:
    """A base with notes at the root and in nested folders, and items that are not notes."""
    base = fake.add_base("Research")
    ops = fake.add_folder(base, "Operations")
    deep = fake.add_folder(base, "Runbooks", parent=ops)
    media = {
        "deploy": fake.add(base, "Deployments", "# Deployments\n\nThe brackenfell rollout starts on Thursday.\n"),
        "oncall": fake.add(base, "On-call", "# On-call\n\nPage the thimbleweed rota first.\n", folder=ops),
        "budget": fake.add(base, "Budget", "# Budget\n\nThe larkspur budget closes in March.\n", folder=deep),
        "pdf": fake.add(base, "Report.pdf", media_type=1),
        "page": fake.add(base, "A web page", media_type=2, folder=ops),
        "image": fake.add(base, "Diagram.png", media_type=9, folder=deep),
        "image2": fake.add(base, "Photo.png", media_type=9),
    }
    return base, media


async def test_listing_walks_bases_and_folders_and_indexes_only_notes(
    fake_ima: FakeIma, make_connector: MakeConnector
) -> None:
    base, media = library(fake_ima)
    big = fake_ima.add_base("Big base")
    for number in range(60):
        fake_ima.add(big, f"Note {number}", f"text {number}\n")

    connector = make_connector()
    items = await listed(connector)

    ids = [item.external_id for item in items]
    assert ids == sorted(ids) and len(ids) == len(set(ids)) == 60 + 3
    assert connector.skipped == {"pdf": 1, "web_page": 1, "image": 2}  # not notes: counted by type
    big_pages = [body for body in fake_ima.calls("get_knowledge_list") if body["knowledge_base_id"] == big.kb_id]
    assert [bool(body["cursor"]) for body in big_pages] == [False, True]  # 60 at 50 a page, then is_end
    folders = {body.get("folder_id") for body in fake_ima.calls("get_knowledge_list")}
    assert len(folders - {None}) == 2  # both folders walked, the nested one too
    assert fake_ima.calls("get_media_info") == [] and fake_ima.calls("get_doc_content") == []

    budget = next(item for item in items if item.title == "Budget")
    assert budget.external_id == f"{base.kb_id}/{media['budget'].media_id}"
    assert (budget.knowledge_base, budget.media_type, budget.acl) == ("Research", "text/markdown", None)
    assert budget.source_version == str(media["budget"].update_time)
    assert b"larkspur budget" in await connector.fetch(budget)
    assert fake_ima.calls("get_doc_content") == [{"note_id": media["budget"].note_id, "target_content_format": 1}]


async def test_configured_bases_and_the_retcode_envelope(fake_ima: FakeIma, make_connector: MakeConnector) -> None:
    base, _ = library(fake_ima)
    other = fake_ima.add_base("Other")
    fake_ima.add(other, "Elsewhere", "text\n")
    fake_ima.retcode_envelope = True
    connector = make_connector(settings={"knowledge_base_ids": [base.kb_id]})
    items = await listed(connector)
    assert {item.metadata["kb_id"] for item in items} == {base.kb_id} and len(items) == 3
    assert fake_ima.calls("search_knowledge_base") == []
    assert b"thimbleweed" in await connector.fetch(next(item for item in items if item.title == "On-call"))


async def test_rate_limits_are_waited_out(fake_ima: FakeIma, make_connector: MakeConnector) -> None:
    library(fake_ima)
    connector = make_connector(throttled_wait_s=0.5)
    item = next(item for item in await listed(connector) if item.title == "Deployments")

    fake_ima.throttle_next(2, path="/openapi/note/v1/get_doc_content")
    started = time.monotonic()
    assert b"brackenfell" in await connector.fetch(item)
    assert time.monotonic() - started >= 0.9  # 110021 twice, each waited for throttled_wait_s
    assert len(fake_ima.calls("get_doc_content")) == 3

    fake_ima.over_quota_next(1)  # HTTP 403 "请求超量": over quota, waited out as well
    quota = make_connector(over_quota_wait_s=0.5)
    started = time.monotonic()
    assert b"brackenfell" in await quota.fetch(item)
    assert time.monotonic() - started >= 0.45 and fake_ima.over_quota == 0

    # The fake's export cap, tighter than the client's pacing: its 110021s are absorbed the same way.
    fake_ima.export_limit = (2, 1.0)
    loose = make_connector(throttled_wait_s=0.4, limits=ImaLimits(export=RateLimit(100, 1.0)))
    items = await listed(loose)
    assert all([await loose.fetch(each) for each in items])
    assert fake_ima.rate_limited > 2

    # Paced to the cap, the client is never refused.
    fake_ima.rate_limited = 0
    fake_ima.forget_exports()
    paced = make_connector(limits=ImaLimits(export=RateLimit(2, 1.0)))
    assert all([await paced.fetch(each) for each in items])
    assert fake_ima.rate_limited == 0


async def test_an_unreadable_note_fails_alone_and_is_remembered(
    fake_ima: FakeIma, make_connector: MakeConnector, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    base, media = library(fake_ima)
    connector = make_connector()
    items = {item.title: item for item in await listed(connector)}

    media["oncall"].denied = True
    with pytest.raises(DocumentUnreadable) as denied:
        await connector.fetch(items["On-call"])
    assert (denied.value.code, denied.value.retryable) == ("permission_denied", False)
    assert "110030" in denied.value.message
    asked = len(fake_ima.calls("get_media_info"))
    with pytest.raises(DocumentUnreadable) as again:
        await connector.fetch(items["On-call"])  # inside the cache's time: no call at all
    assert again.value is denied.value and len(fake_ima.calls("get_media_info")) == asked
    assert b"brackenfell" in await connector.fetch(items["Deployments"])  # the others read on

    media["oncall"].denied = False
    clock.now += 299.0
    with pytest.raises(DocumentUnreadable):
        await connector.fetch(items["On-call"])  # still remembered: a fix shows after five minutes
    assert len(fake_ima.calls("get_media_info")) == asked + 1
    clock.now += 1.0  # the remembered failure has expired: the API is asked again
    assert b"thimbleweed" in await connector.fetch(items["On-call"])

    media["budget"].empty = True
    with pytest.raises(DocumentUnreadable) as empty:
        await connector.fetch(items["Budget"])
    assert empty.value.code == "no_content"

    fake_ima.export_denied = True
    with pytest.raises(DocumentUnreadable) as export:
        await connector.fetch(items["Deployments"])
    assert export.value.code == "permission_denied" and "220030" in export.value.message

    fake_ima.export_denied = False
    fake_ima.delete(base, media["deploy"])
    with pytest.raises(DocumentVanished):
        await make_connector().fetch(items["Deployments"])

    wrong = "wrong-" + uuid.uuid4().hex
    with pytest.raises(ImaAuthError) as refused:
        await listed(make_connector(api_key=wrong))
    assert "HTTP 401" in str(refused.value) and refused.value.__cause__ is None
    assert wrong not in caplog.text


def test_the_registry_builds_it_from_a_connection(fake_ima: FakeIma) -> None:
    credentials = {"client_id": SecretStr("cid"), "api_key": SecretStr("ima-PLANTED-" + uuid.uuid4().hex)}
    row = ConnectionRow(
        "conn-1", "ima", "Notes", {"base_url": fake_ima.base_url, "knowledge_base_ids": [7]}, credentials
    )
    connector = connector_for(row)
    assert isinstance(connector, ImaConnector) and connector.settings.knowledge_base_ids == ["7"]
    assert credentials["api_key"].get_secret_value() not in repr(row)
    with pytest.raises(NoConnector, match="needs credentials api_key"):
        connector_for(ConnectionRow("conn-2", "ima", "Notes", {}, {"client_id": SecretStr("cid")}))


# -- through the embedded pipeline --------------------------------------------------------------


@pytest.fixture
async def cleanup(runtime: Runtime) -> AsyncIterator[list[str]]:
    """Connection ids to delete after the test with everything they indexed."""
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
async def test_sync_indexes_notes_edits_and_deletes_with_an_unreadable_note_failing_alone(
    runtime: Runtime, fake_ima: FakeIma, make_connector: MakeConnector, clock: Clock, cleanup: list[str]
) -> None:
    base, media = library(fake_ima)
    media["oncall"].denied = True
    connector = make_connector()
    cleanup.append(connector.connection_id)

    first = await runtime.pipeline().sync(connector)
    assert [(failure.step, failure.code) for failure in first.failures] == [("fetch", "permission_denied")]
    assert (first.progress.listed, first.progress.indexed) == (3, 2)  # the four non-notes are not listed
    [hit] = await search(runtime, connector.connection_id, "brackenfell rollout")
    assert (hit.title, hit.knowledge_base, hit.platform) == ("Deployments", "Research", "ima")

    fake_ima.requests.clear()
    again = await runtime.pipeline().sync(connector)
    assert (again.progress.unchanged, again.progress.indexed) == (2, 0)
    assert fake_ima.calls("get_media_info") == []  # unchanged: not read; the denied one: remembered
    assert [failure.code for failure in again.failures] == ["permission_denied"]

    clock.now += 300.0  # past the negative cache
    fake_ima.edit(media["deploy"], "# Deployments\n\nThe glimmerwort rollout moved to Mondays.\n")
    fake_ima.delete(base, media["budget"])
    media["oncall"].denied = False
    fake_ima.requests.clear()
    edited = await runtime.pipeline().sync(connector)
    assert edited.ok, edited.failures
    assert sorted(body["media_id"] for body in fake_ima.calls("get_media_info")) == sorted(
        [media["deploy"].media_id, media["oncall"].media_id]
    )
    assert (edited.progress.indexed, edited.progress.deleted) == (2, 1)
    assert await search(runtime, connector.connection_id, "glimmerwort rollout")
    assert not await search(runtime, connector.connection_id, "brackenfell rollout")
    assert not await search(runtime, connector.connection_id, "larkspur budget")
    assert await search(runtime, connector.connection_id, "thimbleweed rota")

    fake_ima.requests.clear()
    unchanged = await runtime.pipeline().sync(connector)
    assert unchanged.ok and unchanged.progress.unchanged == 2
    assert fake_ima.calls("get_media_info") == [] and fake_ima.calls("get_doc_content") == []
