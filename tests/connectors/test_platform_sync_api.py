"""Yuque and IMA connections made over the connections API: stored with encrypted credentials, built
by the registry from the row, synced to Ready and searchable."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream.api.auth import Access
from ragstream.embedded import serve
from ragstream.runtime import open_runtime
from ragstream.settings import Settings
from tests.support.connections import private_database

pytestmark = pytest.mark.usefixtures("private_networks")

if TYPE_CHECKING:
    from tests.support.fake_ima import FakeIma
    from tests.support.fake_yuque import FakeYuque

pytest_plugins = ["tests.support.fake_yuque", "tests.support.fake_ima"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def synced(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Create the connection and wait for its first sync to end; its id and last status."""
    created = await client.post("/v1/connections", json=body)
    assert created.status_code == 201, created.text
    connection_id: str = created.json()["id"]
    status: dict[str, Any] = {}
    for _ in range(600):
        status = (await client.get(f"/v1/connections/{connection_id}/status")).json()
        if status["status"] in ("Ready", "Failed"):
            break
        await asyncio.sleep(0.1)
    return connection_id, status


async def top_result(client: httpx.AsyncClient, connection_id: str, query: str) -> dict[str, Any]:
    found = await client.post("/v1/search", json={"query": query, "filters": {"connection_ids": [connection_id]}})
    assert found.status_code == 200, found.text
    result: dict[str, Any] = found.json()["results"][0]
    return result


@pytest.mark.integration
async def test_yuque_and_ima_connections_sync_to_ready_from_their_stored_credentials(
    database_url: str, fake_yuque: FakeYuque, fake_ima: FakeIma, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    repo = fake_yuque.add_repo("eng/handbook", "Engineering handbook")
    fake_yuque.add_doc(repo, "Deployments", "## Rollout\n\nThe brackenfell rollout starts on Thursday.\n")
    base = fake_ima.add_base("Research")
    fake_ima.add(base, "Budget", "# Budget\n\nThe larkspur budget closes in March.\n")
    fake_ima.add(base, "Report.pdf", media_type=1)
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
                yuque_id, yuque = await synced(
                    client,
                    {
                        "platform": "yuque",
                        "name": "Handbook",
                        "config": {"base_url": fake_yuque.base_url, "repos": ["eng/handbook"]},
                        "credentials": {"token": fake_yuque.token},
                    },
                )
                assert yuque["status"] == "Ready" and yuque["progress"]["indexed"] == 1, yuque
                top = await top_result(client, yuque_id, "brackenfell rollout Thursday")
                assert (top["title"], top["knowledge_base"], top["platform"]) == (
                    "Deployments",
                    "Engineering handbook",
                    "yuque",
                )

                ima_id, ima = await synced(
                    client,
                    {
                        "platform": "ima",
                        "name": "Research notes",
                        "config": {"base_url": fake_ima.base_url},
                        "credentials": {"client_id": fake_ima.client_id, "api_key": fake_ima.api_key},
                    },
                )
                assert ima["status"] == "Ready" and ima["progress"]["indexed"] == 1, ima  # the PDF is skipped
                top = await top_result(client, ima_id, "larkspur budget March")
                assert (top["title"], top["knowledge_base"], top["platform"]) == ("Budget", "Research", "ima")
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
    assert fake_yuque.token not in caplog.text and fake_ima.api_key not in caplog.text
