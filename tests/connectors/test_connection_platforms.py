"""``/v1/connections`` refuses RAG on a platform this build cannot index, at create and at update."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.credentials import CredentialCipher
from ragstream.runtime import Runtime
from ragstream.storage.connections import ConnectionStore

pytestmark = pytest.mark.integration


async def ready() -> bool:
    return True


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    store = ConnectionStore(runtime.pool, CredentialCipher([SecretStr(Fernet.generate_key().decode())]))
    app = create_app(lambda: runtime.retriever, ready=ready, routers=[connections_router(store)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        yield http
    for connection in await store.all():
        if connection.name.startswith("platform-test"):
            await store.delete(connection.id)


async def test_rag_on_a_platform_without_a_connector_is_422(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/v1/connections", json={"platform": "notion", "name": "platform-test"})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "platform"]
    web = await client.post("/v1/connections", json={"platform": "web", "name": "platform-test"})
    assert web.status_code == 422 and "platform web has no connector in this build" in web.text

    dingtalk = {"platform": "dingtalk", "name": "platform-test", "credentials": {"app_key": "k"}}
    refused = await client.post("/v1/connections", json=dingtalk)
    assert refused.status_code == 422
    assert "DingTalk has no API that returns a document's full text" in refused.text
    assert "direct search only" in refused.text

    made = await client.post("/v1/connections", json={**dingtalk, "rag_enabled": False})
    assert made.status_code == 201, made.text  # a direct-search connection
    turned_on = await client.patch(f"/v1/connections/{made.json()['id']}", json={"rag_enabled": True})
    assert turned_on.status_code == 422 and "direct search only" in turned_on.text
    assert (await client.get(f"/v1/connections/{made.json()['id']}")).json()["rag_enabled"] is False

    for platform in ("yuque", "ima", "feishu", "lark"):
        created = await client.post("/v1/connections", json={"platform": platform, "name": "platform-test"})
        assert created.status_code == 201, created.text
    missing = await client.patch("/v1/connections/conn-nope", json={"rag_enabled": True})
    assert missing.status_code == 404
