"""The knowledge tool (``POST /v1/knowledge`` and gRPC ``Knowledge``) of ``ragstream up``: every
operation on every platform, over both transports, against the fake platforms over real HTTP and
the real PostgreSQL; refusals with their exact texts; a write found by the next search."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography.fernet import Fernet
from google.protobuf.json_format import MessageToDict
from pydantic import SecretStr

from ragstream.api.auth import Access
from ragstream.embedded import serve
from ragstream.knowledge.models import elided_body
from ragstream.runtime import open_runtime
from ragstream.settings import Settings
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.support.connections import private_database
from tests.support.fake_dingtalk import APP_KEY, APP_SECRET, OPERATOR, FakeDingTalk
from tests.support.fake_feishu import FakeFeishu
from tests.support.fake_ima import FakeIma
from tests.support.fake_yuque import FakeYuque

pytest_plugins = [
    "tests.support.fake_dingtalk",
    "tests.support.fake_feishu",
    "tests.support.fake_ima",
    "tests.support.fake_yuque",
]
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_networks")]

TRANSPORTS = ["http", "grpc"]
USER = {"user": "ada", "groups": ["eng"]}
# Long enough that a search result (a snippet, or a chunk cut to the budget) cannot be the whole text.
PARAGRAPHS = [f"Paragraph {number} of the appendix says nothing new." for number in range(80)]
FILLER = " ".join(PARAGRAPHS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    http: httpx.AsyncClient
    stub: retrieval_pb2_grpc.RetrievalStub
    #: Folder connections made over the API must lie in here.
    folders: Path


@pytest.fixture(scope="module")
async def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    """``ragstream up`` (HTTP and gRPC) on a database of its own, for the module's tests."""
    folders = tmp_path_factory.mktemp("knowledge-folders")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGSTREAM_ALLOW_PRIVATE_NETWORKS", "true")
        patch.setenv("RAGSTREAM_FOLDER_ROOTS", str(folders))
        settings = Settings(
            database_url=database_url,
            credential_keys=SecretStr(Fernet.generate_key().decode()),
            scheduler_enabled=False,
            sync_progress_interval_s=0.2,
            direct_search_timeout_s=10,
        )
        port, grpc_port = free_port(), free_port()
        async with private_database(database_url) as dsn, open_runtime(settings, dsn) as runtime:
            task = asyncio.create_task(
                serve(runtime, [], "127.0.0.1", port, 0, grpc_port=grpc_port, access=Access.open())
            )
            try:
                async with (
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client,
                    grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
                ):
                    for _ in range(400):
                        try:
                            if (await client.get("/healthz")).status_code == 200:
                                break
                        except httpx.TransportError:
                            await asyncio.sleep(0.05)
                    yield Server(client, retrieval_pb2_grpc.RetrievalStub(channel), folders)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def tool(server: Server) -> Server:
    """The server with no connection left from an earlier test (``platform`` must name one)."""
    for connection in (await server.http.get("/v1/connections")).json():
        deleted = await server.http.delete(f"/v1/connections/{connection['id']}")
        assert deleted.status_code == 204, deleted.text
    return server


# --- calling the tool over either transport -----------------------------------------------------------


def grpc_request(body: dict[str, Any]) -> retrieval_pb2.KnowledgeRequest:
    fields = {key: value for key, value in body.items() if key not in ("principal", "filters")}
    message = retrieval_pb2.KnowledgeRequest(**fields)
    if "principal" in body:
        message.principal.CopyFrom(retrieval_pb2.Principal(**body["principal"]))
    for name, values in (body.get("filters") or {}).items():
        getattr(message.filters, name).values.extend(values)
    return message


async def call(server: Server, transport: str, body: dict[str, Any], *, status: int = 200) -> dict[str, Any]:
    """The tool's answer as JSON; over HTTP its status must be ``status`` (gRPC answers OK)."""
    if transport == "http":
        response = await server.http.post("/v1/knowledge", json=body)
        assert response.status_code == status, response.text
        answer: dict[str, Any] = response.json()
        return answer
    reply = await server.stub.Knowledge(grpc_request(body))
    return MessageToDict(reply, preserving_proto_field_name=True)


def error_of(answer: dict[str, Any]) -> tuple[str, str]:
    error = answer.get("error")
    assert error, answer
    return error["code"], error["message"]


def result_of(answer: dict[str, Any], key: str) -> dict[str, Any]:
    assert not answer.get("error"), answer
    result: dict[str, Any] = answer[key]
    return result


# --- connections ------------------------------------------------------------------------------------


async def connect(server: Server, body: dict[str, Any]) -> str:
    created = await server.http.post("/v1/connections", json=body)
    assert created.status_code == 201, created.text
    connection_id: str = created.json()["id"]
    return connection_id


async def last_run(server: Server, connection_id: str) -> dict[str, Any] | None:
    runs = (await server.http.get(f"/v1/connections/{connection_id}/syncs", params={"limit": 1})).json()
    return runs[0] if runs else None


async def settled(server: Server, connection_id: str, *, after: int = 0) -> dict[str, Any]:
    """The connection's newest run, once one newer than run ``after`` has ended."""
    for _ in range(900):
        run = await last_run(server, connection_id)
        if run is not None and run["id"] > after and run["status"] in ("Ready", "Failed"):
            return run
        await asyncio.sleep(0.1)
    raise AssertionError(f"no sync of {connection_id} ended")


def yuque_body(fake: FakeYuque, *, rag: bool, repos: list[str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"base_url": fake.base_url}
    if repos is not None:
        config["repos"] = repos
    return {
        "platform": "yuque",
        "name": "Handbook",
        "config": config,
        "credentials": {"token": fake.token},
        "rag_enabled": rag,
    }


def ima_body(fake: FakeIma, *, rag: bool) -> dict[str, Any]:
    return {
        "platform": "ima",
        "name": "Research notes",
        "config": {"base_url": fake.base_url},
        "credentials": {"client_id": fake.client_id, "api_key": fake.api_key},
        "rag_enabled": rag,
    }


def dingtalk_body(fake: FakeDingTalk) -> dict[str, Any]:
    return {
        "platform": "dingtalk",
        "name": "Team drive",
        "config": {"base_url": fake.base_url},
        "credentials": {"app_key": APP_KEY, "app_secret": APP_SECRET, "operator_union_id": OPERATOR},
        "rag_enabled": False,
    }


def feishu_body(fake: FakeFeishu, space_id: str) -> dict[str, Any]:
    return {
        "platform": "feishu",
        "name": "Team wiki",
        "config": {"base_url": fake.base_url, "space_ids": [space_id]},
        "credentials": {"app_id": fake.app_id, "app_secret": fake.app_secret},
    }


# --- search -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_search_covers_every_platform_unless_one_is_named(
    tool: Server, transport: str, fake_yuque: FakeYuque, fake_ima: FakeIma, fake_dingtalk: FakeDingTalk
) -> None:
    fake_yuque.add_doc(fake_yuque.add_repo("eng/ops", "Operations"), "Marigold runbook", "Marigold restarts nightly.")
    fake_ima.add(fake_ima.add_base("Research"), "Marigold study", "The marigold trial ended.")
    fake_ima.add_note("Marigold notebook", "My marigold seeds sprouted.")
    fake_dingtalk.add("Marigold plan", "Plant the marigold beds in May.")
    yuque = await connect(tool, yuque_body(fake_yuque, rag=False))
    await connect(tool, ima_body(fake_ima, rag=False))
    await connect(tool, dingtalk_body(fake_dingtalk))

    everywhere = result_of(await call(tool, transport, {"action": "search", "query": "marigold"}), "search")

    titles = {(result["platform"], result["title"]) for result in everywhere["results"]}
    assert titles == {
        ("yuque", "Marigold runbook"),
        ("ima", "Marigold study"),
        ("ima", "Marigold notebook"),  # search_note: the key owner's notebooks
        ("dingtalk", "Marigold plan"),
    }
    assert all(result["mode"] == "direct" for result in everywhere["results"])
    assert fake_ima.calls("search_note") and fake_ima.calls("search_note")[0]["query"] == "marigold"

    named = await call(tool, transport, {"action": "search", "query": "marigold", "platform": "yuque"})
    assert [result["title"] for result in result_of(named, "search")["results"]] == ["Marigold runbook"]
    by_id = await call(tool, transport, {"action": "search", "query": "marigold", "connection_id": yuque})
    assert [result["connection_id"] for result in result_of(by_id, "search")["results"]] == [yuque]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_second_empty_search_in_a_row_carries_the_sync_hint(
    tool: Server, transport: str, fake_yuque: FakeYuque
) -> None:
    fake_yuque.add_doc(fake_yuque.add_repo("eng/ops", "Operations"), "Snapdragon", "Snapdragon seeds.")
    await connect(tool, yuque_body(fake_yuque, rag=False))
    conversation = f"hint-{transport}"

    async def search(query: str, conversation_id: str = conversation) -> dict[str, Any]:
        body = {"action": "search", "query": query, "conversation_id": conversation_id}
        return await call(tool, transport, body)

    first = await search("quetzalcoatl")
    assert result_of(first, "search").get("results", []) == [] and not first.get("hint")
    second = await search("quetzalcoatl again")
    assert "index may be stale" in second["hint"] and "/sync" in second["hint"]
    assert not (await search("nothing", f"{conversation}-other")).get("hint")  # per conversation
    third = await search("still nothing")
    assert second["hint"] != third["hint"] and third["hint"].startswith("3 searches in a row")
    found = await search("snapdragon")
    assert result_of(found, "search")["results"] and not found.get("hint")
    assert not (await search("quetzalcoatl")).get("hint")  # the run starts again


# --- read -------------------------------------------------------------------------------------------


async def read_after_search(tool: Server, transport: str, conversation: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The "Verbena" result of a search in ``conversation`` (after a first search numbered the index
    page 1), and the read of that result in the same conversation."""
    for query in ("pages", "verbena care"):
        found = await call(tool, transport, {"action": "search", "query": query, "conversation_id": conversation})
    results = result_of(found, "search")["results"]
    top = next(result for result in results if result["title"].split(" > ")[-1] == "Verbena")
    body = {"action": "read", "document_id": top["document_id"], "conversation_id": conversation}
    read = result_of(await call(tool, transport, body), "read")
    return top, read


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "platform", ["yuque", "yuque-rag", "ima", "ima-rag", "ima-notebook", "dingtalk", "feishu", "folder"]
)
async def test_read_gives_the_whole_document_under_its_citation_number(
    tool: Server,
    transport: str,
    platform: str,
    fake_yuque: FakeYuque,
    fake_ima: FakeIma,
    fake_dingtalk: FakeDingTalk,
    fake_feishu: FakeFeishu,
) -> None:
    ending = "The verbena stock is kept in the north shed."
    text = f"Verbena care. {FILLER} {ending}"
    if platform.startswith("yuque"):
        repo = fake_yuque.add_repo("eng/garden", "Garden")
        fake_yuque.add_doc(repo, "Verbena", text)
        fake_yuque.add_doc(repo, "Verbena index", "Verbena pages.")
        connection = await connect(tool, yuque_body(fake_yuque, rag=platform == "yuque-rag"))
    elif platform in ("ima", "ima-rag"):
        base = fake_ima.add_base("Garden")
        fake_ima.add(base, "Verbena index", "Verbena pages.")
        fake_ima.add(base, "Verbena", text)
        connection = await connect(tool, ima_body(fake_ima, rag=platform == "ima-rag"))
    elif platform == "ima-notebook":
        fake_ima.add_note("Verbena index", "Verbena pages.")
        fake_ima.add_note("Verbena", text)
        connection = await connect(tool, ima_body(fake_ima, rag=False))
    elif platform == "dingtalk":
        fake_dingtalk.add("Verbena index", "Verbena pages.")
        fake_dingtalk.add("Verbena", "Verbena care.", *PARAGRAPHS, ending)
        connection = await connect(tool, dingtalk_body(fake_dingtalk))
    elif platform == "feishu":
        space = fake_feishu.add_space("Garden")
        fake_feishu.add_node(space, "Verbena index", "# Verbena index\n\nVerbena pages.\n")
        fake_feishu.add_node(space, "Verbena", f"# Verbena\n\n{text}\n")
        connection = await connect(tool, feishu_body(fake_feishu, space.space_id))
    else:
        folder = tool.folders / uuid.uuid4().hex
        folder.mkdir()
        (folder / "Verbena index.md").write_text("# Verbena index\n\nVerbena pages.\n")
        (folder / "Verbena.md").write_text(f"# Verbena\n\n{text}\n")
        body = {"platform": "folder", "name": "Garden", "config": {"path": str(folder)}}
        connection = await connect(tool, body)
    if platform in ("yuque-rag", "ima-rag", "feishu", "folder"):
        assert (await settled(tool, connection))["status"] == "Ready"

    top, read = await read_after_search(tool, transport, f"read-{platform}-{transport}")

    assert read["document_id"] == top["document_id"] and read["connection_id"] == connection
    assert read["citation_index"] == top["citation_index"] == 2
    assert ending not in top["text"]  # search gave a part, read gives the whole
    assert ending in read["text"] and len(read["text"]) > len(FILLER) and not read.get("truncated")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_read_of_an_unknown_or_foreign_document_is_not_found(
    tool: Server, transport: str, fake_yuque: FakeYuque
) -> None:
    repo = fake_yuque.add_repo("eng/private", "Private", public=0)
    doc = fake_yuque.add_doc(repo, "Secret plan", "The secret plan.")
    connection = await connect(tool, yuque_body(fake_yuque, rag=False))
    live = f"direct:{connection}:eng/private/{doc.id}"

    for body in (
        {"action": "read", "document_id": "no-such-document"},
        {"action": "read", "document_id": f"direct:{connection}:eng/private/999"},
        {"action": "read", "document_id": live},  # private: the caller holds no yuque:eng/private
        {"action": "read", "document_id": live, "principal": USER},
        {"action": "read", "document_id": live, "platform": "ima"},
    ):
        assert error_of(await call(tool, transport, body))[0] == "not_found", body
    allowed = {"user": "ada", "groups": ["yuque:eng/private"]}
    read = await call(tool, transport, {"action": "read", "document_id": live, "principal": allowed})
    assert result_of(read, "read")["text"] == "The secret plan."


# --- list_documents ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_list_documents_browses_an_ima_base_by_folder(tool: Server, transport: str, fake_ima: FakeIma) -> None:
    base = fake_ima.add_base("Research")
    fake_ima.add_base("Archive")
    folder = fake_ima.add_folder(base, "Trials")
    inner = fake_ima.add_folder(base, "2026", parent=folder)
    note = fake_ima.add(base, "Hollyhock trial", "Hollyhock trial notes.", folder=inner)
    fake_ima.add(base, "Hollyhock.pdf", media_type=1, folder=inner)
    fake_ima.add(base, "Overview", "Overview of the research.")
    connection = await connect(tool, ima_body(fake_ima, rag=False))

    bases = result_of(await call(tool, transport, {"action": "list_documents", "platform": "ima"}), "documents")
    assert {(entry["kind"], entry["title"]) for entry in bases["entries"]} == {
        ("knowledge_base", "Research"),
        ("knowledge_base", "Archive"),
    }
    assert bases["connection_id"] == connection

    root = await call(tool, transport, {"action": "list_documents", "platform": "ima", "knowledge_base_id": base.kb_id})
    entries = {(entry["kind"], entry["title"]) for entry in result_of(root, "documents")["entries"]}
    assert entries == {("folder", "Trials"), ("document", "Overview")}

    body = {"action": "list_documents", "connection_id": connection, "knowledge_base_id": base.kb_id}
    listed = result_of(await call(tool, transport, {**body, "folder_id": inner}), "documents")
    assert [step["name"] for step in listed["path"]] == ["Trials", "2026"]
    by_title = {entry["title"]: entry for entry in listed["entries"]}
    assert by_title["Hollyhock trial"]["media_type"] == "note" and by_title["Hollyhock trial"]["document_id"]
    assert by_title["Hollyhock.pdf"]["media_type"] == "pdf" and not by_title["Hollyhock.pdf"].get("document_id")

    read = await call(tool, transport, {"action": "read", "document_id": by_title["Hollyhock trial"]["document_id"]})
    assert result_of(read, "read")["text"] == note.content

    first = result_of(await call(tool, transport, {**body, "folder_id": inner, "limit": 1}), "documents")
    assert len(first["entries"]) == 1 and first["next_cursor"]
    rest = await call(tool, transport, {**body, "folder_id": inner, "limit": 1, "cursor": first["next_cursor"]})
    assert len(result_of(rest, "documents")["entries"]) == 1 and not result_of(rest, "documents").get("next_cursor")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("platform", ["yuque", "dingtalk", "feishu", "lark", "folder", "web"])
async def test_list_documents_is_ima_only(tool: Server, transport: str, platform: str) -> None:
    code, message = error_of(await call(tool, transport, {"action": "list_documents", "platform": platform}))
    assert code == "unsupported_operation"
    assert message.startswith(f"Platform '{platform}' does not support list_documents")


# --- create and update: refusals and validation -----------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("platform", ["dingtalk", "feishu", "lark", "ima", "folder", "web"])
async def test_create_and_update_are_refused_where_the_platform_has_no_write(
    tool: Server, transport: str, platform: str
) -> None:
    written = {"principal": USER, "title": "Minutes", "body": "# Minutes\n\nWe agreed on the plan."}
    create = await call(tool, transport, {"action": "create", "platform": platform, **written})
    assert error_of(create) == ("unsupported_operation", f"Platform '{platform}' does not support document creation")
    update = await call(tool, transport, {"action": "update", "platform": platform, "document_id": "x", **written})
    assert error_of(update) == ("unsupported_operation", f"Platform '{platform}' does not support document updates")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_dingtalk_refuses_creation_with_the_documented_words_by_connection_too(
    tool: Server, transport: str, fake_dingtalk: FakeDingTalk
) -> None:
    connection = await connect(tool, dingtalk_body(fake_dingtalk))
    dentry = fake_dingtalk.add("Minutes", "Old minutes.")
    written = {"principal": USER, "title": "Minutes", "body": "# Minutes\n\nWe agreed on the plan."}
    create = await call(tool, transport, {"action": "create", "connection_id": connection, **written})
    assert error_of(create) == ("unsupported_operation", "Platform 'dingtalk' does not support document creation")
    document_id = f"direct:{connection}:{dentry.uuid}"
    update = await call(tool, transport, {"action": "update", "document_id": document_id, **written})
    assert error_of(update) == ("unsupported_operation", "Platform 'dingtalk' does not support document updates")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "body",
    [
        "",
        "   \n",
        "Summary: the meeting agreed on the plan.",
        "# Minutes\n\nWe agreed on the plan.\n\n...\n",
        "# Minutes\n\n(rest unchanged)",
        "# 会议纪要\n\n其余内容不变",
    ],
)
async def test_a_write_without_a_full_body_is_refused_by_validation(
    tool: Server, transport: str, body: str, fake_yuque: FakeYuque
) -> None:
    fake_yuque.add_repo("eng/notes", "Notes")
    await connect(tool, yuque_body(fake_yuque, rag=False, repos=["eng/notes"]))
    request = {"action": "create", "platform": "yuque", "principal": USER, "title": "Minutes", "body": body}
    code, message = error_of(await call(tool, transport, request, status=422))
    assert code == "invalid_request" and "full document body" in message
    assert not [path for path, _, _ in fake_yuque.requests if path.endswith("/docs")]  # nothing was sent


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_invalid_requests_are_structured_errors(tool: Server, transport: str) -> None:
    for body in (
        {"action": "delete", "document_id": "x"},
        {"action": "search"},
        {"action": "read"},
        {"action": "search", "query": "x", "top_k": 31},
        {"action": "create", "platform": "yuque", "title": "t"},
    ):
        code, _ = error_of(await call(tool, transport, body, status=422))
        assert code == "invalid_request", body
    if transport == "http":
        broken = await tool.http.post(
            "/v1/knowledge", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert broken.status_code == 422 and broken.json()["error"]["code"] == "invalid_request"


# --- create and update on Yuque ---------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_write_on_a_live_yuque_connection_is_found_by_the_next_search(
    tool: Server, transport: str, fake_yuque: FakeYuque
) -> None:
    repo = fake_yuque.add_repo("eng/notes", "Notes")
    connection = await connect(tool, yuque_body(fake_yuque, rag=False))
    body = f"# Larch survey\n\nThe larch survey found 41 nests. {FILLER}"
    request = {"action": "create", "platform": "yuque", "knowledge_base": "eng/notes", "title": "Larch survey"}

    written = result_of(await call(tool, transport, {**request, "principal": USER, "body": body}), "written")

    (doc,) = repo.docs.values()
    assert doc.body == body and doc.title == "Larch survey"
    assert written["indexing"] == "live" and written["connection_id"] == connection
    assert written["document_id"] == f"direct:{connection}:eng/notes/{doc.id}"
    assert written["url"] == f"{fake_yuque.base_url}/eng/notes/{doc.slug}"
    found = result_of(await call(tool, transport, {"action": "search", "query": "larch"}), "search")
    assert [result["document_id"] for result in found["results"]] == [written["document_id"]]

    new_body = body.replace("41 nests", "57 nests")
    update = {"action": "update", "document_id": written["document_id"], "principal": USER, "body": new_body}
    updated = result_of(await call(tool, transport, update), "written")
    assert updated["document_id"] == written["document_id"] and doc.body == new_body
    read = result_of(await call(tool, transport, {"action": "read", "document_id": written["document_id"]}), "read")
    assert "57 nests" in read["text"] and "41 nests" not in read["text"]

    short = {**update, "body": "# Larch survey\n\nThe survey found nests."}
    code, message = error_of(await call(tool, transport, short))
    assert code == "invalid_request" and "under a quarter" in message and doc.body == new_body
    assert result_of(await call(tool, transport, {**short, "shorten": True}), "written")
    assert doc.body == short["body"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_write_on_a_rag_yuque_connection_is_synced_into_the_index(
    tool: Server, transport: str, fake_yuque: FakeYuque
) -> None:
    repo = fake_yuque.add_repo("eng/notes", "Notes")
    fake_yuque.add_doc(repo, "Existing", "An older page about spruce.")
    connection = await connect(tool, yuque_body(fake_yuque, rag=True, repos=["eng/notes"]))
    first = await settled(tool, connection)
    assert first["status"] == "Ready" and first["indexed"] == 1
    fake_yuque.requests.clear()

    body = "# Hemlock survey\n\nThe hemlock survey counted 23 saplings.\n"
    create = {"action": "create", "platform": "yuque", "principal": USER, "title": "Hemlock survey", "body": body}
    written = result_of(await call(tool, transport, create), "written")

    assert written["indexing"] == "sync_started"
    synced = await settled(tool, connection, after=first["id"])
    assert synced["status"] == "Ready" and synced["indexed"] == 1 and synced["unchanged"] == 1
    (new,) = [doc for doc in repo.docs.values() if doc.title == "Hemlock survey"]
    assert fake_yuque.content_requests() == [f"eng/notes/{new.id}"]  # only the written doc is downloaded
    found = result_of(await call(tool, transport, {"action": "search", "query": "hemlock saplings"}), "search")
    top = found["results"][0]
    assert top["document_id"] == written["document_id"] and top["mode"] == "rag" and "23 saplings" in top["text"]

    update = {
        "action": "update",
        "document_id": written["document_id"],
        "principal": USER,
        "body": body.replace("23 saplings", "31 saplings"),
    }
    assert result_of(await call(tool, transport, update), "written")["indexing"] == "sync_started"
    assert (await settled(tool, connection, after=synced["id"]))["status"] == "Ready"
    again = result_of(await call(tool, transport, {"action": "search", "query": "hemlock saplings"}), "search")
    assert "31 saplings" in again["results"][0]["text"] and "23 saplings" not in again["results"][0]["text"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_writes_need_a_principal_who_may_see_the_place(
    tool: Server, transport: str, fake_yuque: FakeYuque
) -> None:
    private = fake_yuque.add_repo("eng/private", "Private", public=0)
    await connect(tool, yuque_body(fake_yuque, rag=False))
    body = {"action": "create", "platform": "yuque", "knowledge_base": "eng/private", "title": "Plan", "body": "Plan."}

    assert error_of(await call(tool, transport, body))[0] == "invalid_request"  # no principal
    assert error_of(await call(tool, transport, {**body, "principal": USER}))[0] == "forbidden"
    assert not private.docs
    member = {"user": "ada", "groups": ["yuque:eng/private"]}
    assert (
        result_of(await call(tool, transport, {**body, "principal": member}), "written")["knowledge_base"] == "Private"
    )
    assert [doc.title for doc in private.docs.values()] == ["Plan"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_platform_failures_of_a_write_are_structured_errors(
    tool: Server, transport: str, fake_yuque: FakeYuque
) -> None:
    locked = fake_yuque.add_repo("eng/locked", "Locked")
    locked.read_only = True
    fake_yuque.add_repo("eng/notes", "Notes")
    connection = await connect(tool, yuque_body(fake_yuque, rag=False, repos=["eng/notes", "eng/locked"]))
    body = {"action": "create", "platform": "yuque", "principal": USER, "title": "Plan", "body": "Plan."}

    assert error_of(await call(tool, transport, {**body, "knowledge_base": "eng/locked"}))[0] == "forbidden"
    code, message = error_of(await call(tool, transport, {**body, "knowledge_base": "eng/other"}))
    assert code == "forbidden" and "not one of this connection's" in message
    code, message = error_of(await call(tool, transport, body))
    assert code == "invalid_request" and "eng/notes, eng/locked" in message  # which repo is ambiguous
    fake_yuque.throttle_next(10, reset_s=1)
    code, _ = error_of(await call(tool, transport, {**body, "knowledge_base": "eng/notes"}))
    assert code == "platform_unavailable"
    fake_yuque.throttles.clear()
    missing = {**body, "action": "update", "document_id": f"direct:{connection}:eng/notes/404404"}
    assert error_of(await call(tool, transport, missing))[0] == "not_found"
    await connect(tool, yuque_body(fake_yuque, rag=False))
    code, message = error_of(await call(tool, transport, {**body, "knowledge_base": "eng/notes"}))
    assert code == "ambiguous_connection" and connection in message


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unreadable_ima_note_is_not_asked_again_within_five_minutes(
    tool: Server, transport: str, fake_ima: FakeIma
) -> None:
    base = fake_ima.add_base("Research")
    note = fake_ima.add(base, "Locked trial", "Locked trial notes.")
    note.denied = True
    body = {"platform": "ima", "config": {"base_url": fake_ima.base_url, "knowledge_base_ids": [base.kb_id]}}
    connection = await connect(tool, {**ima_body(fake_ima, rag=False), **body})
    read = {"action": "read", "document_id": f"direct:{connection}:{base.kb_id}/{note.media_id}"}

    first = error_of(await call(tool, transport, read))
    assert first[0] == "forbidden" and len(fake_ima.calls("get_media_info")) == 1
    note.denied = False  # fixed on the platform: the remembered failure still answers for a while
    assert error_of(await call(tool, transport, read)) == first
    assert len(fake_ima.calls("get_media_info")) == 1

    # A connection limited to some bases searches only them, not the key owner's notebooks.
    fake_ima.add_note("Locked notebook", "Locked trial in my notebook.")
    found = result_of(await call(tool, transport, {"action": "search", "query": "locked"}), "search")
    assert [result["title"] for result in found["results"]] == ["Locked trial"]
    assert fake_ima.calls("search_note") == []


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unknown_platform_or_a_folder_without_its_base_is_an_invalid_request(
    tool: Server, transport: str, fake_ima: FakeIma
) -> None:
    code, message = error_of(await call(tool, transport, {"action": "search", "query": "x", "platform": "notion"}))
    assert code == "invalid_request" and "unknown platform 'notion'" in message
    await connect(tool, ima_body(fake_ima, rag=False))
    listing = {"action": "list_documents", "platform": "ima", "folder_id": "folder_1"}
    assert error_of(await call(tool, transport, listing))[0] == "invalid_request"
    for action in ("list_documents", "create"):
        body = {"action": action, "title": "t", "body": "Full text.", "principal": USER}
        code, message = error_of(await call(tool, transport, body))
        assert code == "invalid_request" and "platform or a connection_id" in message, action


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ("# Plan\n\nWe ship on Friday.", False),
        ("Numbers... and dots inside a sentence.", False),
        ("# API\n\n```python\nclass Port(Protocol):\n    def open(self) -> None:\n        ...\n```\n", False),
        ("The rest is unchanged for now, as agreed.", False),
        ("", True),
        ("TL;DR: ship it", True),
        ("摘要：发布流程", True),
        ("# Plan\n\n…\n", True),
        ("# Plan\n\n[...]\n\nEnd.", True),
        ("# Plan\n\n<!-- rest of the document unchanged -->", True),
        ("# 计划\n\n（以下省略）", True),
        ("# API\n\n```\ncode\n```\n\n...\n", True),
    ],
)
def test_a_full_body_is_told_from_a_summary_or_an_excerpt(body: str, refused: bool) -> None:
    assert (elided_body(body) is not None) is refused
