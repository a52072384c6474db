"""The outbound gate: http(s) only, no private, loopback, link-local or metadata address, checked on
every request and every redirect hop, with the request sent to the address that was checked."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from ragstream import outbound
from ragstream.connectors.feishu import FeishuClient
from ragstream.settings import EmbeddingSettings, Settings

if TYPE_CHECKING:
    from tests.support.fake_feishu import FakeFeishu

pytest_plugins = ["tests.support.fake_feishu"]

PUBLIC = "93.184.216.34"
DNS = {"vendor.test": [PUBLIC], "intranet.test": ["10.0.0.1"], "mixed.test": [PUBLIC, "192.168.1.9"]}


@pytest.fixture(autouse=True)
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Names resolve from ``DNS``; IP literals resolve to themselves, as getaddrinfo does."""
    monkeypatch.delenv("RAGSTREAM_ALLOW_PRIVATE_NETWORKS", raising=False)
    names = {name: list(addresses) for name, addresses in DNS.items()}

    def resolve(host: str, port: int) -> list[str]:
        if host in names:
            return names[host]
        if host[0].isdigit() or ":" in host:
            return [host]
        raise outbound.OutboundRefused(f"cannot resolve {host}")

    monkeypatch.setattr(outbound, "resolve", resolve)
    return names


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:8080/", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://intranet.test/", r"10\.0\.0\.1, a private"),
        ("https://mixed.test/", r"192\.168\.1\.9, a private"),
        ("http://[::1]/", "loopback"),
        ("http://[fd00::1]/", "private"),
        ("http://100.64.0.7/", "CGNAT"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("ftp://x/", "scheme 'ftp' is not allowed"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
    ],
)
def test_urls_that_are_refused(url: str, reason: str) -> None:
    with pytest.raises(outbound.OutboundRefused, match=reason):
        outbound.check_url(url)


def test_a_public_name_passes_and_private_networks_can_be_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert outbound.check_url("https://vendor.test/api") == PUBLIC
    assert outbound.check_url("http://intranet.test/", allow_private=True) is None
    monkeypatch.setenv("RAGSTREAM_ALLOW_PRIVATE_NETWORKS", "true")
    assert outbound.check_url("http://127.0.0.1:1/") is None
    with pytest.raises(outbound.OutboundRefused, match="scheme"):
        outbound.check_url("ftp://x/")


def recording(answer: Callable[[httpx.Request], httpx.Response]) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(request)

    return httpx.MockTransport(handler), seen


async def test_each_request_goes_to_the_checked_address_with_its_name_kept() -> None:
    network, seen = recording(lambda request: httpx.Response(200, json={"ok": True}))
    async with outbound.client(transport=network, base_url="https://vendor.test") as client:
        assert (await client.get("/v1/ping")).json() == {"ok": True}
    (sent,) = seen
    assert (sent.url.host, sent.headers["host"], sent.extensions["sni_hostname"]) == (
        PUBLIC,
        "vendor.test",
        "vendor.test",
    )


async def test_a_name_that_now_resolves_privately_is_refused_once_its_check_expires(
    fake_dns: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(outbound, "monotonic", lambda: now[0])
    network, seen = recording(lambda request: httpx.Response(200))
    async with outbound.client(transport=network, base_url="https://vendor.test") as client:
        await client.get("/first")
        fake_dns["vendor.test"] = ["10.0.0.1"]  # DNS rebinding: the name moved into the network
        await client.get("/second")  # still to the address that was checked, not into the network
        now[0] += outbound.CHECKED_ADDRESS_TTL_S
        with pytest.raises(outbound.OutboundRefused, match=re.escape("10.0.0.1")):
            await client.get("/third")
    assert [(request.url.path, request.url.host) for request in seen] == [("/first", PUBLIC), ("/second", PUBLIC)]


async def test_a_client_resolves_a_name_once_while_its_check_holds(
    fake_dns: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved: list[str] = []
    resolve = outbound.resolve

    def counting(host: str, port: int) -> list[str]:
        resolved.append(host)
        return resolve(host, port)

    monkeypatch.setattr(outbound, "resolve", counting)
    network, seen = recording(lambda request: httpx.Response(200))
    async with outbound.client(transport=network, base_url="https://vendor.test") as client:
        for _ in range(3):
            await client.get("/ping")
        # Another name is checked on its own.
        with pytest.raises(outbound.OutboundRefused, match=re.escape("192.168.1.9")):
            await client.get("https://mixed.test/")
    assert resolved == ["vendor.test", "mixed.test"]
    assert [request.url.host for request in seen] == [PUBLIC] * 3


async def test_a_redirect_to_a_private_host_is_refused() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(302, headers={"location": "http://intranet.test/admin"})

    network, seen = recording(answer)
    async with outbound.client(transport=network, follow_redirects=True) as client:
        with pytest.raises(outbound.OutboundRefused, match=re.escape("intranet.test resolves to 10.0.0.1")):
            await client.get("https://vendor.test/start")
    assert [request.headers["host"] for request in seen] == ["vendor.test"]


def test_the_blocking_client_checks_redirects_too() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["host"])
        return httpx.Response(301, headers={"location": "http://169.254.169.254/latest/meta-data/"})

    with (
        outbound.sync_client(transport=httpx.MockTransport(handler), follow_redirects=True) as client,
        pytest.raises(outbound.OutboundRefused, match="link-local"),
    ):
        client.get("https://vendor.test/model.jar")
    assert calls == ["vendor.test"]


async def test_a_real_request_to_loopback_never_connects(fake_feishu: FakeFeishu) -> None:
    """The fake Feishu answers on 127.0.0.1: without the opt-in, the connector's client is refused
    before anything (the app secret included) is sent."""
    client = FeishuClient("cli_victim", SecretStr("VICTIM-SECRET"), base_url=fake_feishu.base_url)
    try:
        with pytest.raises(outbound.OutboundRefused, match="loopback"):
            await client.space("7012")
    finally:
        await client.aclose()
    assert fake_feishu.token_requests == 0 and fake_feishu.requests == []


def test_vendor_urls_in_settings_must_be_http() -> None:
    with pytest.raises(ValidationError, match="scheme 'ftp'"):
        EmbeddingSettings(provider="openai", base_url="ftp://x/v1")
    with pytest.raises(ValidationError, match="scheme 'gopher'"):
        Settings(dashscope_base_url="gopher://x")
    assert EmbeddingSettings(provider="openai", base_url="https://api.example.com/v1").base_url
