"""The one gate of outbound HTTP: http(s) only, and no private, loopback or metadata address.

Every client that reaches a vendor (a connector, an embedder, the reranker, a model download) is
built by ``client()`` (or ``sync_client()``), whose transport checks each request it sends, each
redirect hop included, since httpx sends every hop through the transport. The host is resolved
and refused when any of its addresses is loopback, private (RFC 1918, ULA), link-local (which holds
the cloud metadata address 169.254.169.254), unspecified, multicast, reserved or CGNAT; the request
then goes to the address that was checked (the name stays in the Host header and TLS SNI), so a
name that resolves differently a moment later (DNS rebinding) cannot slip through. A client keeps a
host's checked address for ``CHECKED_ADDRESS_TTL_S``: its requests go on to that address without a
resolution each (a thread and a DNS round trip inside every request of an embedder's few slots); a
name that moved is resolved and checked again once that time is up.
``RAGSTREAM_ALLOW_PRIVATE_NETWORKS=true`` lifts the address rule (a vendor stand-in on the LAN, the
tests' fakes on 127.0.0.1); the scheme rule always holds.

Usage, for a new connector:
    self._client = outbound.client(base_url=config.base_url, timeout=httpx.Timeout(30))
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from time import monotonic
from typing import Annotated, Any

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragstream.core.errors import InvalidInput

__all__ = [
    "CHECKED_ADDRESS_TTL_S",
    "OutboundRefused",
    "OutboundSettings",
    "UnresolvableHost",
    "check_scheme",
    "check_url",
    "client",
    "resolve",
    "sync_client",
]

_SCHEMES = frozenset({"http", "https"})
_CGNAT = ipaddress.ip_network("100.64.0.0/10")

#: How long a client sends to a host's checked address before resolving and checking the name again.
CHECKED_ADDRESS_TTL_S = 30.0


class OutboundSettings(BaseSettings):
    """Where outbound requests may go."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_")

    allow_private_networks: Annotated[
        bool,
        Field(
            title="Allow requests to private, loopback and link-local addresses",
            description="Off: a vendor URL (a connection's config.base_url, an embedder's) must resolve to "
            "public addresses only. On: for vendor stand-ins on a private network.",
        ),
    ] = False


class OutboundRefused(InvalidInput, ValueError):
    """A URL the gate does not let a request go to; the message says why (never a secret)."""


class UnresolvableHost(OutboundRefused):
    """The URL's host name did not resolve: it may later, unlike the other refusals."""


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (tests replace this function to fake DNS)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise UnresolvableHost(f"cannot resolve {host}: {error}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def check_scheme(url: str | httpx.URL) -> httpx.URL:
    """``url`` parsed, if it is http(s) with a host; ``OutboundRefused`` otherwise."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise OutboundRefused(f"invalid URL: {error}") from None
    if parsed.scheme not in _SCHEMES:
        raise OutboundRefused(f"URL scheme {parsed.scheme or '(none)'!r} is not allowed: use http or https")
    if not parsed.host:
        raise OutboundRefused("URL has no host")
    return parsed


def check_url(url: str | httpx.URL, *, allow_private: bool | None = None) -> str | None:
    """Check ``url`` as a request to it would be checked; returns the address to connect to (None when
    private networks are allowed, which resolves nothing). Raises ``OutboundRefused``."""
    parsed = check_scheme(url)
    if _allowed_private(allow_private):
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    addresses = resolve(parsed.host, port)
    if not addresses:
        raise OutboundRefused(f"{parsed.host} resolves to no address")
    for address in addresses:
        reason = _private_reason(address)
        if reason is not None:
            raise OutboundRefused(
                f"{parsed.host} resolves to {address}, a {reason} address; requests go to public addresses only "
                "unless RAGSTREAM_ALLOW_PRIVATE_NETWORKS=true"
            )
    return addresses[0]


def client(
    *, allow_private: bool | None = None, transport: httpx.AsyncBaseTransport | None = None, **options: Any
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose every request passes the gate. ``options`` go to httpx as they are
    (``base_url``, ``headers``, ``timeout``, ``limits``, ``follow_redirects``); ``transport`` replaces the
    network below the gate (tests); ``allow_private`` None reads RAGSTREAM_ALLOW_PRIVATE_NETWORKS."""
    limits = options.pop("limits", httpx.Limits())  # a client given a transport ignores its own limits
    inner = transport or httpx.AsyncHTTPTransport(limits=limits)
    return httpx.AsyncClient(transport=_GuardedTransport(inner, _allowed_private(allow_private)), **options)


def sync_client(
    *, allow_private: bool | None = None, transport: httpx.BaseTransport | None = None, **options: Any
) -> httpx.Client:
    """The blocking ``client()``, for downloads outside the event loop."""
    inner = transport or httpx.HTTPTransport()
    return httpx.Client(transport=_GuardedSyncTransport(inner, _allowed_private(allow_private)), **options)


def _allowed_private(allow_private: bool | None) -> bool:
    return OutboundSettings().allow_private_networks if allow_private is None else allow_private


def _private_reason(address: str) -> str | None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id ("fe80::1%eth0") is not part of it
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for reason, hit in (
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("unspecified", ip.is_unspecified),
        ("multicast", ip.is_multicast),
        ("reserved", ip.is_reserved),
        ("private", ip.is_private),
        ("shared (CGNAT)", ip in _CGNAT),
        ("non-public", not ip.is_global),
    ):
        if hit:
            return reason
    return None


def _pinned(request: httpx.Request, address: str | None) -> httpx.Request:
    """``request`` sent to the checked ``address``; the Host header keeps the name, and TLS verifies it."""
    if address is None:
        return request
    host = request.url.host
    extensions = {**request.extensions, "sni_hostname": host}
    return httpx.Request(
        request.method,
        request.url.copy_with(host=address),
        headers=request.headers,
        stream=request.stream,
        extensions=extensions,
    )


class _GuardedTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, allow_private: bool) -> None:
        self._inner = inner
        self._allow_private = allow_private
        # (scheme, host, port) -> the checked address, and until when it is used without a new check
        self._checked: dict[tuple[str, str, int | None], tuple[str, float]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._inner.handle_async_request(_pinned(request, await self._address(request.url)))

    async def _address(self, url: httpx.URL) -> str | None:
        if self._allow_private:  # nothing to resolve: the scheme rule alone
            return check_url(url, allow_private=True)
        key, now = (url.scheme, url.host, url.port), monotonic()
        checked = self._checked.get(key)
        if checked is not None and now < checked[1]:
            return checked[0]
        # Resolution blocks (getaddrinfo), so it runs in a thread, as asyncio's own resolver does.
        address = await asyncio.to_thread(check_url, url, allow_private=False)
        if address is not None:
            self._checked[key] = (address, now + CHECKED_ADDRESS_TTL_S)
        return address

    async def aclose(self) -> None:
        await self._inner.aclose()


class _GuardedSyncTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, allow_private: bool) -> None:
        self._inner = inner
        self._allow_private = allow_private

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        address = check_url(request.url, allow_private=self._allow_private)
        return self._inner.handle_request(_pinned(request, address))

    def close(self) -> None:
        self._inner.close()
