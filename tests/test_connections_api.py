"""``/v1/connections``: CRUD, validation, the fixed ACL switch, RAG off and on, delete of everything indexed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.credentials import CredentialCipher
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import Runtime
from ragstream.storage.connections import ConnectionStore
from tests.support.connections import BoundFolder

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("folder_roots")]


async def ready() -> bool:
    return True


class Hooks:
    """Records the connection ids the router asks to sync."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.rag_enabled: list[str] = []

    async def on_created(self, connection_id: str) -> None:
        self.created.append(connection_id)

    async def on_rag_enabled(self, connection_id: str) -> None:
        self.rag_enabled.append(connection_id)


@pytest.fixture
def store(runtime: Runtime) -> ConnectionStore:
    return ConnectionStore(runtime.pool, CredentialCipher([SecretStr(Fernet.generate_key().decode())]))


@pytest.fixture
def hooks() -> Hooks:
    return Hooks()


@pytest.fixture
async def client(runtime: Runtime, store: ConnectionStore, hooks: Hooks) -> AsyncIterator[httpx.AsyncClient]:
    router = connections_router(store, on_created=hooks.on_created, on_rag_enabled=hooks.on_rag_enabled)
    app = create_app(lambda: runtime.retriever, ready=ready, routers=[router])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        yield http


async def search_ids(runtime: Runtime, connection_id: str, query: str) -> list[str]:
    filters = SearchFilters(connection_ids=[connection_id])
    response = await runtime.retriever.search(SearchRequest(query=query, filters=filters))
    return [result.document_id for result in response.results]


async def test_crud_round_trip(client: httpx.AsyncClient, hooks: Hooks, corpus: Path) -> None:
    body: dict[str, Any] = {
        "platform": "feishu",
        "name": "Team wiki",
        "config": {"space_id": "7012", "chunking": {"kind": "recursive", "size": 800, "overlap": 80}},
        "credentials": {"app_id": "cli_a1", "app_secret": "s3cr3t"},
        "schedule_seconds": 3600,
    }
    created = await client.post("/v1/connections", json=body)
    assert created.status_code == 201, created.text
    made = created.json()
    cid = made["id"]
    assert cid.startswith("conn-") and hooks.created == [cid]
    assert made["has_credentials"] and made["credential_fields"] == ["app_id", "app_secret"]
    assert "credentials" not in made and "s3cr3t" not in created.text
    assert made["config"]["space_id"] == "7012" and made["config"]["chunking"]["size"] == 800
    assert (made["rag_enabled"], made["skip_acl"], made["status"], made["schedule_seconds"]) == (
        True,
        False,
        "active",
        3600,
    )

    assert (await client.get(f"/v1/connections/{cid}")).json() == made
    assert cid in [c["id"] for c in (await client.get("/v1/connections")).json()]

    patched = await client.patch(
        f"/v1/connections/{cid}",
        json={"name": "Wiki", "status": "disabled", "config": {"embedding": {"provider": "local"}}, "credentials": {}},
    )
    assert patched.status_code == 200, patched.text
    changed = patched.json()
    assert (changed["name"], changed["status"], changed["has_credentials"], changed["credential_fields"]) == (
        "Wiki",
        "disabled",
        False,
        [],
    )
    assert changed["config"]["space_id"] == "7012" and changed["config"]["embedding"]["provider"] == "local"
    assert changed["updated_at"] > made["updated_at"]

    folder = await client.post(
        "/v1/connections", json={"platform": "folder", "name": "docs", "config": {"path": str(corpus)}}
    )
    assert folder.status_code == 201 and folder.json()["has_credentials"] is False
    off = await client.post("/v1/connections", json={"platform": "web", "name": "site", "rag_enabled": False})
    assert off.status_code == 201 and off.json()["id"] not in hooks.created

    assert (await client.delete(f"/v1/connections/{cid}")).status_code == 204
    assert (await client.get(f"/v1/connections/{cid}")).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"platform": "notion", "name": "x"},
        {"platform": "feishu", "name": ""},
        {"platform": "feishu"},
        {"platform": "folder", "name": "no path"},
        {"platform": "folder", "name": "missing", "config": {"path": "/no/such/folder"}},
        {"platform": "feishu", "name": "x", "schedule_seconds": -1},
        {"platform": "feishu", "name": "x", "credentials": {"token": 5}},
        {"platform": "feishu", "name": "x", "config": {"chunking": {"kind": "bogus"}}},
        {"platform": "feishu", "name": "x", "config": {"embedding": {"provider": "bogus"}}},
        {"platform": "feishu", "name": "x", "config": {"embedding": {"provider": "openai", "model": "m"}}},
        {"platform": "feishu", "name": "x", "config": {"embedding": {"provider": "local", "model": "bge-m3"}}},
        {"platform": "feishu", "name": "x", "config": {"embedding": {"provider": "dashscope", "dimension": 0}}},
        {"platform": "feishu", "name": "x", "unknown": True},
    ],
)
async def test_bad_input_is_422(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await client.post("/v1/connections", json=body)
    assert response.status_code == 422, response.text


async def test_a_file_is_not_a_folder(client: httpx.AsyncClient, corpus: Path) -> None:
    (corpus / "a.md").write_text("# A\n")
    config = {"path": str(corpus / "a.md")}
    response = await client.post("/v1/connections", json={"platform": "folder", "name": "f", "config": config})
    assert response.status_code == 422 and "not an existing directory" in response.text


async def test_credentials_without_a_key_are_refused_clearly(runtime: Runtime) -> None:
    app = create_app(
        lambda: runtime.retriever,
        ready=ready,
        routers=[connections_router(ConnectionStore(runtime.pool, CredentialCipher([])))],
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        body = {"platform": "yuque", "name": "docs", "credentials": {"token": "t"}}
        refused = await client.post("/v1/connections", json=body)
        assert refused.status_code == 422 and "RAGSTREAM_CREDENTIAL_KEYS" in refused.json()["detail"]
        assert (await client.post("/v1/connections", json={**body, "credentials": None})).status_code == 201


async def test_unknown_ids_are_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/connections/conn-nope")).status_code == 404
    assert (await client.patch("/v1/connections/conn-nope", json={"name": "x"})).status_code == 404
    assert (await client.delete("/v1/connections/conn-nope")).status_code == 404


async def test_skip_acl_is_fixed_at_creation(client: httpx.AsyncClient) -> None:
    made = (await client.post("/v1/connections", json={"platform": "ima", "name": "n", "skip_acl": True})).json()
    for value in (False, True):
        response = await client.patch(f"/v1/connections/{made['id']}", json={"skip_acl": value, "name": "renamed"})
        assert response.status_code == 422 and "skip_acl is fixed" in response.text
    after = (await client.get(f"/v1/connections/{made['id']}")).json()
    assert (after["skip_acl"], after["name"]) == (True, "n")
    bad = await client.patch(f"/v1/connections/{made['id']}", json={"status": "gone", "schedule_seconds": -5})
    assert bad.status_code == 422


async def index_folder(runtime: Runtime, client: httpx.AsyncClient, corpus: Path) -> str:
    (corpus / "otters.md").write_text("# Otters\n\n## Diet\n\nThe zephyrine otter eats sea urchins at dusk.\n")
    (corpus / "kelp.md").write_text("# Kelp\n\nZephyrine kelp forests shelter the otters from storms.\n")
    made = await client.post(
        "/v1/connections", json={"platform": "folder", "name": "c", "config": {"path": str(corpus)}}
    )
    cid = str(made.json()["id"])
    report = await runtime.pipeline().sync(BoundFolder(cid, corpus))
    assert report.ok and report.progress.indexed == 2
    return cid


async def test_rag_off_removes_the_index_and_on_again_resyncs_everything(
    runtime: Runtime, client: httpx.AsyncClient, hooks: Hooks, corpus: Path
) -> None:
    cid = await index_folder(runtime, client, corpus)
    assert len(await search_ids(runtime, cid, "zephyrine otter")) == 2

    off = await client.patch(f"/v1/connections/{cid}", json={"rag_enabled": False})
    assert off.status_code == 200 and off.json()["rag_enabled"] is False
    assert await search_ids(runtime, cid, "zephyrine otter") == []
    assert (await client.get(f"/v1/connections/{cid}")).status_code == 200
    pool = runtime.pool
    ids = [r["id"] for r in await pool.fetch("SELECT id FROM documents WHERE connection_id = $1", cid)]
    rows = await pool.fetch("SELECT title, source, status, metadata FROM documents WHERE connection_id = $1", cid)
    assert [(r["title"], r["source"], r["status"]) for r in rows] == [("", "", "deleted")] * 2
    for table in ("chunks", "staged_documents", "pending_batches"):
        assert await pool.fetchval(f"SELECT count(*) FROM {table} WHERE document_id = ANY($1::text[])", ids) == 0
    assert hooks.rag_enabled == []

    on = await client.patch(f"/v1/connections/{cid}", json={"rag_enabled": True})
    assert on.status_code == 200 and hooks.rag_enabled == [cid]
    again = await client.patch(f"/v1/connections/{cid}", json={"rag_enabled": True})
    assert again.status_code == 200 and hooks.rag_enabled == [cid]  # already on: no second sync
    report = await runtime.pipeline().sync(BoundFolder(cid, corpus))
    assert (report.progress.unchanged, report.progress.indexed) == (0, 2)
    assert len(await search_ids(runtime, cid, "zephyrine otter")) == 2


async def test_delete_removes_every_row_the_connection_indexed(
    runtime: Runtime, client: httpx.AsyncClient, corpus: Path
) -> None:
    cid = await index_folder(runtime, client, corpus)
    pool = runtime.pool
    ids = [r["id"] for r in await pool.fetch("SELECT id FROM documents WHERE connection_id = $1", cid)]
    chunk_ids = [r["id"] for r in await pool.fetch("SELECT id FROM chunks WHERE document_id = ANY($1::text[])", ids)]
    # Citations from a search in a conversation, and rows of work in flight that no foreign key ties to it.
    filters = SearchFilters(connection_ids=[cid])
    await runtime.retriever.search(SearchRequest(query="zephyrine", filters=filters, conversation_id=f"conv-{cid}"))
    await pool.execute(
        "INSERT INTO pending_batches (document_id, version, batch_index, batch_count, payload)"
        " VALUES ($1, nextval('document_versions'), 0, 2, $2)",
        ids[0],
        b"{}",
    )
    await pool.execute(
        "INSERT INTO runs (kind, connection_id, trigger, status) VALUES ('sync', $1, 'api', 'succeeded')", cid
    )
    await pool.execute(
        "INSERT INTO document_failures (document_id, connection_id, source, version, step, code, message, retryable)"
        " VALUES ('never-committed', $1, 'x.md', 1, 'parse', 'bad', 'm', false)",
        cid,
    )
    await pool.execute(
        "INSERT INTO staged_documents (version, document_id, content)"
        " VALUES (nextval('document_versions'), 'never-committed', 'raw')"
    )
    spaces = [r["table_name"] for r in await pool.fetch("SELECT table_name FROM embedding_spaces")]

    documents = [*ids, "never-committed"]
    where: dict[str, tuple[str, Any]] = {
        "connections": ("id = $1", cid),
        "documents": ("connection_id = $1", cid),
        "document_failures": ("connection_id = $1", cid),
        "runs": ("connection_id = $1", cid),
        **{
            table: ("document_id = ANY($1::text[])", documents)
            for table in ("chunks", "staged_documents", "pending_batches", "conversation_citations")
        },
        **{space: ("chunk_id = ANY($1::text[])", chunk_ids) for space in spaces},
    }

    async def counts() -> dict[str, int]:
        return {
            table: await pool.fetchval(f"SELECT count(*) FROM {table} WHERE {clause}", value)
            for table, (clause, value) in where.items()
        }

    before = await counts()
    assert before["chunks"] > 0 and before["conversation_citations"] == 2 and before["runs"] == 1
    assert sum(before[space] for space in spaces) == len(chunk_ids) > 0
    assert before["staged_documents"] >= 3 and before["pending_batches"] == 1 and before["document_failures"] == 1

    assert (await client.delete(f"/v1/connections/{cid}")).status_code == 204
    assert await counts() == dict.fromkeys(where, 0)
    assert await search_ids(runtime, cid, "zephyrine otter") == []


async def test_an_embedding_model_equal_to_the_stored_one_starts_no_reindex(
    runtime: Runtime, store: ConnectionStore
) -> None:
    """A spec stored before the configs, with a field its provider ignores, is still the same model."""
    changes: list[tuple[str, dict[str, Any] | None]] = []

    async def on_embedding_changed(connection_id: str, spec: dict[str, Any] | None) -> None:
        changes.append((connection_id, spec))

    router = connections_router(store, on_embedding_changed=on_embedding_changed)
    app = create_app(lambda: runtime.retriever, ready=ready, routers=[router])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        made = await client.post("/v1/connections", json={"platform": "web", "name": "site", "rag_enabled": False})
        cid = made.json()["id"]
        legacy = '{"provider": "local", "model": "left-over", "base_url": null}'
        await runtime.pool.execute(
            "UPDATE connections SET config = config || jsonb_build_object('embedding', $2::jsonb) WHERE id = $1",
            cid,
            legacy,
        )

        same = await client.patch(f"/v1/connections/{cid}", json={"config": {"embedding": {"provider": "local"}}})
        assert same.status_code == 200, same.text
        assert changes == []

        onnx = {"provider": "onnx", "model": "bge-small-en-v1.5"}
        other = await client.patch(f"/v1/connections/{cid}", json={"config": {"embedding": onnx}})
        assert other.status_code == 200, other.text
        assert changes == [(cid, onnx)]
