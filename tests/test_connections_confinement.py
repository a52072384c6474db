"""What a connection made over ``/v1/connections`` may reach: folders inside RAGSTREAM_FOLDER_ROOTS only,
vendor URLs on public addresses only, and stored credentials never sent to a base_url changed without
them; a folder whose root is withdrawn later stops syncing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream import outbound
from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.connectors.base import ClosingConnector
from ragstream.connectors.registry import ConnectionRow, NoConnector, connector_for, register_folder
from ragstream.credentials import CredentialCipher
from ragstream.runtime import Runtime
from ragstream.storage.connections import ConnectionStore

pytestmark = pytest.mark.integration

DNS = {"open.feishu.test": ["93.184.216.34"], "mirror.feishu.test": ["93.184.216.35"], "intranet.test": ["10.0.0.1"]}
SECRETS = {"app_id": "cli_victim", "app_secret": "VICTIM-SECRET-67890"}


async def ready() -> bool:
    return True


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGSTREAM_ALLOW_PRIVATE_NETWORKS", raising=False)
    monkeypatch.delenv("RAGSTREAM_FOLDER_ROOTS", raising=False)

    def resolve(host: str, port: int) -> list[str]:
        return DNS.get(host, [host])

    monkeypatch.setattr(outbound, "resolve", resolve)


@pytest.fixture
async def shared(runtime: Runtime) -> AsyncIterator[Runtime]:
    """The session's runtime; the connections a test adds are deleted after it."""
    before = [row["id"] for row in await runtime.pool.fetch("SELECT id FROM connections")]
    yield runtime
    await runtime.pool.execute("DELETE FROM connections WHERE NOT (id = ANY($1::text[]))", before)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "root"
    (folder / "kb").mkdir(parents=True)
    return folder


async def api(shared: Runtime, roots: list[Path] | None) -> httpx.AsyncClient:
    store = ConnectionStore(shared.pool, CredentialCipher([SecretStr(Fernet.generate_key().decode())]))
    app = create_app(lambda: shared.retriever, ready=ready, routers=[connections_router(store, folder_roots=roots)])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def client(shared: Runtime, root: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with await api(shared, [root]) as http:
        yield http


async def create(client: httpx.AsyncClient, platform: str, config: dict[str, Any], **body: Any) -> httpx.Response:
    return await client.post(
        "/v1/connections", json={"platform": platform, "name": "c", "config": config, "rag_enabled": False, **body}
    )


async def test_folders_outside_the_roots_are_refused(client: httpx.AsyncClient, root: Path, tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside", target_is_directory=True)
    for path, reason in (
        ("/etc", "outside RAGSTREAM_FOLDER_ROOTS"),
        ("../../../../etc", "is relative"),
        (f"{root}/kb/../../outside", "outside RAGSTREAM_FOLDER_ROOTS"),
        (str(tmp_path / "outside"), "outside RAGSTREAM_FOLDER_ROOTS"),
        (str(root / "escape"), "outside RAGSTREAM_FOLDER_ROOTS"),
        (str(root / "missing"), "not an existing directory"),
    ):
        refused = await create(client, "folder", {"path": path})
        assert refused.status_code == 422 and reason in refused.text, (path, refused.text)

    made = await create(client, "folder", {"path": f"{root}/kb/."})
    assert made.status_code == 201, made.text
    assert made.json()["config"]["path"] == str(root / "kb")
    moved = await client.patch(f"/v1/connections/{made.json()['id']}", json={"config": {"path": "/etc"}})
    assert moved.status_code == 422 and "outside RAGSTREAM_FOLDER_ROOTS" in moved.text


async def test_without_roots_no_folder_connection_is_made_over_the_api(shared: Runtime, root: Path) -> None:
    async with await api(shared, None) as client:
        refused = await create(client, "folder", {"path": str(root / "kb")})
    assert refused.status_code == 422 and "need RAGSTREAM_FOLDER_ROOTS" in refused.text


async def test_a_withdrawn_root_stops_the_sync_while_operator_folders_still_sync(
    client: httpx.AsyncClient, shared: Runtime, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = (await create(client, "folder", {"path": str(root / "kb")})).json()
    row = ConnectionRow(made["id"], "folder", "c", made["config"])
    monkeypatch.setenv("RAGSTREAM_FOLDER_ROOTS", str(root))
    assert connector_for(row).connection_id == made["id"]
    monkeypatch.setenv("RAGSTREAM_FOLDER_ROOTS", str(tmp_path / "elsewhere"))
    with pytest.raises(NoConnector, match="outside RAGSTREAM_FOLDER_ROOTS"):
        connector_for(row)
    # What `ragstream ingest` / `up --source` registered is the operator's, roots or not.
    operator_folder = tmp_path / "operator"
    operator_folder.mkdir()
    registered = await register_folder(shared.store, operator_folder)
    assert connector_for(ConnectionRow(registered, "folder", "o", {"path": str(operator_folder)})).connection_id
    with pytest.raises(NoConnector, match="outside RAGSTREAM_FOLDER_ROOTS"):  # the same id, another path
        connector_for(ConnectionRow(registered, "folder", "o", {"path": "/etc"}))


@pytest.mark.parametrize(
    ("base_url", "reason"),
    [
        ("http://127.0.0.1:18704", "loopback"),
        ("http://169.254.169.254", "link-local"),
        ("https://intranet.test", "intranet.test resolves to 10.0.0.1, a private address"),
        ("ftp://x", "scheme 'ftp' is not allowed"),
    ],
)
async def test_vendor_urls_on_private_addresses_are_refused(
    client: httpx.AsyncClient, base_url: str, reason: str
) -> None:
    refused = await create(client, "feishu", {"base_url": base_url}, credentials=SECRETS)
    assert refused.status_code == 422 and reason in refused.text, refused.text
    embedding = {"embedding": {"provider": "openai", "base_url": base_url, "model": "m", "dimension": 8}}
    refused = await create(client, "feishu", embedding, credentials=SECRETS)
    assert refused.status_code == 422 and "base_url" in refused.text and reason in refused.text, refused.text


async def test_a_private_base_url_is_refused_when_the_sync_sends_its_request(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = (await create(client, "feishu", {"base_url": "https://open.feishu.test"}, credentials=SECRETS)).json()
    rebound = {**DNS, "open.feishu.test": ["10.0.0.1"]}  # the name was rebound after the check
    monkeypatch.setattr(outbound, "resolve", lambda host, port: rebound.get(host, [host]))
    secrets = {name: SecretStr(value) for name, value in SECRETS.items()}
    connector = connector_for(ConnectionRow(made["id"], "feishu", "c", made["config"], secrets))
    assert isinstance(connector, ClosingConnector)
    try:
        with pytest.raises(outbound.OutboundRefused, match="private"):
            [item async for item in connector.list_items()]
    finally:
        await connector.aclose()


async def test_changing_the_base_url_needs_the_credentials_again(client: httpx.AsyncClient) -> None:
    made = (await create(client, "feishu", {"base_url": "https://open.feishu.test"}, credentials=SECRETS)).json()
    url = f"/v1/connections/{made['id']}"

    refused = await client.patch(url, json={"config": {"base_url": "https://mirror.feishu.test"}})
    assert refused.status_code == 422 and "needs the credentials again" in refused.text
    assert (await client.get(url)).json()["config"]["base_url"] == "https://open.feishu.test"
    private = await client.patch(url, json={"config": {"base_url": "http://127.0.0.1:18704"}, "credentials": SECRETS})
    assert private.status_code == 422 and "loopback" in private.text

    same = await client.patch(url, json={"config": {"base_url": "https://open.feishu.test", "space_ids": ["7"]}})
    assert same.status_code == 200, same.text
    moved = await client.patch(url, json={"config": {"base_url": "https://mirror.feishu.test"}, "credentials": SECRETS})
    assert moved.status_code == 200, moved.text
    assert moved.json()["config"]["base_url"] == "https://mirror.feishu.test" and moved.json()["has_credentials"]

    bare = (await create(client, "feishu", {"base_url": "https://open.feishu.test"})).json()
    changed = await client.patch(
        f"/v1/connections/{bare['id']}", json={"config": {"base_url": "https://mirror.feishu.test"}}
    )
    assert changed.status_code == 200, changed.text  # nothing stored to leak
