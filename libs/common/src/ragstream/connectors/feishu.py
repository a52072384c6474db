"""Feishu / Lark wiki connector: the docx pages of wiki spaces, read as Markdown through the open platform.

Vendor facts come from ``docs/platform-apis.md`` §2; where it is silent
the choice is marked ASSUMPTION here and in ``tests/support/fake_feishu.py``.

- **Auth:** a tenant_access_token from the app's ``app_id`` + ``app_secret`` (§2.1), cached until
  ``token_refresh_margin_s`` before it expires (3 minutes, as the official Go SDK does) and fetched
  again, once per request, when a call answers one of the invalid-token codes.
- **Listing:** the configured ``space_ids`` (else every space the app is a member of), each walked
  breadth first through ``wiki/v2/spaces/:space_id/nodes`` with ``page_token`` pagination; a page may
  be empty while ``has_more`` is true, so only ``has_more`` ends a listing. Only ``docx`` nodes are
  documents here: legacy ``doc``, ``sheet``, ``bitable``, ``mindnote``, ``file`` and ``slides`` nodes
  have no text route in §2.3 and are skipped (their children are still walked), and shortcuts are
  skipped because their origin node is listed in its own space.
- **Content:** ``docs/v1/content`` with ``content_type=markdown`` (default), which keeps headings, so
  chunks keep their section path; ``content_format: plain`` uses ``docx/v1/.../raw_content`` instead,
  for an app without the ``docs:document.content:read`` scope.
- **Limits and errors:** requests are paced per API group within the documented windows (wiki 100/min,
  content 5/s); HTTP 429, code 99991400 under any status, 5xx, timeouts and dropped connections are
  retried with jittered backoff, a throttled one after ``x-ogw-ratelimit-reset`` seconds. A document
  the app may not read fails alone (``DocumentUnreadable``); a listing that fails fails the sync,
  because a partial listing would delete what it missed.

Secrets (the app secret, tenant tokens) never reach a message: server text is redacted, and httpx
errors are never chained, since their request objects carry the Authorization header.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.vendor_http import RateLimit, RetryPolicy, Transient, VendorError, VendorHttp, json_body
from ragstream.vendor_http import retry_after as platform_wait

__all__ = [
    "FEISHU_BASE_URL",
    "LARK_BASE_URL",
    "FeishuAuthError",
    "FeishuClient",
    "FeishuConfig",
    "FeishuConnector",
    "FeishuError",
    "FeishuLimits",
    "FeishuRetry",
    "RateLimit",
    "TenantTokenAuth",
]

logger = logging.getLogger(__name__)

FEISHU_BASE_URL = "https://open.feishu.cn"
LARK_BASE_URL = "https://open.larksuite.com"

TOKEN_PATH = "/open-apis/auth/v3/tenant_access_token/internal"
SPACES_PATH = "/open-apis/wiki/v2/spaces"
SPACE_PATH = "/open-apis/wiki/v2/spaces/{space_id}"
NODES_PATH = "/open-apis/wiki/v2/spaces/{space_id}/nodes"
MARKDOWN_PATH = "/open-apis/docs/v1/content"
RAW_CONTENT_PATH = "/open-apis/docx/v1/documents/{document_id}/raw_content"
SEARCH_PATH = "/open-apis/search/v2/doc_wiki/search"

#: The codes after which the official Go SDK fetches a new token and retries once (§2.1).
TOKEN_INVALID_CODES = frozenset({99991671, 99991664, 99991663})
#: "request trigger frequency limit": HTTP 429, or 400 from the docx block API (§2.6).
RATE_LIMITED_CODE = 99991400
#: The app may not read this item: 99991672 a scope the app lacks (§2.6); 1770032 "forBidden" (docx),
#: 131006 "node permission denied" (wiki) and 91403 "Forbidden" (drive) from third-party reports and
#: the drive error-code page, not from §2. ASSUMPTION: each means "this document", never "this app".
PERMISSION_CODES = frozenset({99991672, 1770032, 131006, 91403})
#: The document is gone: 1002 "document deleted" (generic error-code page). ASSUMPTION: 1770002 (docx
#: "not found") and HTTP 404 mean the same.
GONE_CODES = frozenset({1002, 1770002})

#: ``page_size`` maximum of the spaces and nodes lists (§2.2).
PAGE_SIZE = 50

#: Retries and backoff of the Feishu calls (the shared policy under its old name).
FeishuRetry = RetryPolicy


class FeishuError(VendorError):
    """What the platform answered (``status``, envelope ``code`` and ``msg``), without any secret.

    ``retryable``: a later attempt may succeed unchanged (throttled, 5xx, network)."""

    @property
    def denied(self) -> bool:
        return self.status == 403 or self.code in PERMISSION_CODES

    @property
    def gone(self) -> bool:
        return self.status == 404 or self.code in GONE_CODES


class FeishuAuthError(FeishuError):
    """No tenant token: a wrong app id or secret, or a disabled app. Nothing can be read, so it fails
    the sync rather than each document."""


@dataclass(frozen=True, slots=True)
class FeishuLimits:
    """Client-side pacing per API group, from the documented windows (§2.6). ``content`` is documented
    for docs/v1/content; ASSUMPTION: raw_content shares the 5/s of the docx APIs. The windows are per
    app and tenant at the platform, so two connections of one app share them: the retries absorb it."""

    wiki: RateLimit = field(default_factory=lambda: RateLimit(100, 60.0))
    content: RateLimit = field(default_factory=lambda: RateLimit(5, 1.0))


@dataclass(slots=True)
class _Token:
    value: str
    expires_at: float  # time.monotonic()


class TenantTokenAuth(httpx.Auth):
    """Sends the tenant token as a Bearer header; when the platform answers one of the invalid-token
    codes, asks ``tokens`` for a new one (passing the rejected token) and sends the request once more.
    That repeat is not paced again: it replaces a call the platform refused at once."""

    def __init__(self, tokens: Callable[[str | None], Awaitable[str]]) -> None:
        self._tokens = tokens

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token = await self._tokens(None)
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        await response.aread()  # the envelope's code tells an invalid token
        if json_body(response).get("code") in TOKEN_INVALID_CODES:
            request.headers["Authorization"] = f"Bearer {await self._tokens(token)}"
            yield request


class FeishuClient:
    """The open-platform calls the connector makes, with the tenant token, pacing and retries.

    The HTTP pool is opened on first use and closed by ``aclose``; the token cache outlives it, so a
    connector reused for another sync does not ask for a token again."""

    def __init__(
        self,
        app_id: str,
        app_secret: SecretStr,
        *,
        base_url: str = FEISHU_BASE_URL,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        limits: FeishuLimits | None = None,
        token_refresh_margin_s: float = 180.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not app_id or not app_secret.get_secret_value():
            raise ValueError("a Feishu client needs app_id and app_secret")
        self._app_id = app_id
        self._app_secret = app_secret
        limits = limits or FeishuLimits()
        self._http = VendorHttp(
            "feishu",
            base_url,
            timeout_s=timeout_s,
            limits={"wiki": limits.wiki, "content": limits.content},
            retry=retry,
            transport=transport,
            secrets=lambda: [self._app_secret.get_secret_value(), *self._issued],
            error_type=FeishuError,
        )
        self._auth = TenantTokenAuth(self._tenant_token)
        self._margin_s = token_refresh_margin_s
        self._token: _Token | None = None
        self._token_lock = asyncio.Lock()
        # Every token ever issued to this client, for redaction (a server may echo the one it rejected).
        self._issued: set[str] = set()

    async def aclose(self) -> None:
        await self._http.aclose()

    def redact(self, text: str) -> str:
        return self._http.redact(text)

    # -- the calls ---------------------------------------------------------------------------

    def spaces(self) -> AsyncIterator[dict[str, Any]]:
        """Every wiki space the app is a member of."""
        return self._pages(SPACES_PATH, {})

    async def space(self, space_id: str) -> dict[str, Any]:
        data = await self._get(SPACE_PATH.format(space_id=space_id), {}, "wiki")
        space = data.get("space")
        if not isinstance(space, dict):
            raise FeishuError(f"space {space_id}: the answer has no data.space", retryable=False)
        return space

    def nodes(self, space_id: str, parent_node_token: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The child nodes of ``parent_node_token`` (the space's root nodes without it)."""
        params = {"parent_node_token": parent_node_token} if parent_node_token else {}
        return self._pages(NODES_PATH.format(space_id=space_id), params)

    async def markdown(self, document_id: str) -> str:
        params = {"doc_token": document_id, "doc_type": "docx", "content_type": "markdown"}
        return self._content(await self._get(MARKDOWN_PATH, params, "content"), document_id)

    async def raw_content(self, document_id: str) -> str:
        return self._content(
            await self._get(RAW_CONTENT_PATH.format(document_id=document_id), {}, "content"), document_id
        )

    async def search(
        self, query: str, *, page_size: int, page_token: str | None = None, space_ids: list[str] | None = None
    ) -> dict[str, Any]:
        """One page of unified search (§2.4), the one Feishu search a tenant token may call: docs and
        wiki pages, or only the wiki pages of ``space_ids``. ``data`` holds ``res_units``,
        ``has_more`` and ``page_token``."""
        body: dict[str, Any] = {"query": query, "page_size": page_size}
        if space_ids:
            body["wiki_filter"] = {"space_ids": space_ids}
        else:
            body["doc_filter"], body["wiki_filter"] = {}, {}
        if page_token:
            body["page_token"] = page_token
        return await self._post(SEARCH_PATH, body, "wiki")

    @staticmethod
    def _content(data: dict[str, Any], document_id: str) -> str:
        content = data.get("content")
        if not isinstance(content, str):
            raise FeishuError(f"document {document_id}: the answer has no data.content", retryable=False)
        return content

    async def _pages(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Items of every page. A page may be empty while ``has_more`` is true (the platform filters
        by permission after paging), so only ``has_more`` ends the listing."""
        page_token: str | None = None
        while True:
            query = {**params, "page_size": str(PAGE_SIZE)}
            if page_token:
                query["page_token"] = page_token
            data = await self._get(path, query, "wiki")
            for item in data.get("items") or []:
                if isinstance(item, dict):
                    yield item
            if not data.get("has_more"):
                return
            following = data.get("page_token")
            if not isinstance(following, str) or not following or following == page_token:
                # Asking again with the same token would loop forever; an incomplete listing must
                # fail the sync rather than delete what it did not reach.
                raise FeishuError(f"{path}: has_more without a new page_token", retryable=False)
            page_token = following

    # -- the machinery -----------------------------------------------------------------------

    async def _get(self, path: str, params: Mapping[str, str], group: str) -> dict[str, Any]:
        """``data`` of a successful answer, after the retries; raises ``FeishuError``."""
        body = await self._http.retrying(lambda: self._call_once(path, params, group), path)
        data = body.get("data")
        return data if isinstance(data, dict) else {}

    async def _post(self, path: str, body: dict[str, Any], group: str) -> dict[str, Any]:
        """``data`` of a successful POST, after the retries; raises ``FeishuError``."""
        answer = await self._http.retrying(lambda: self._call_once(path, {}, group, body), path)
        data = answer.get("data")
        return data if isinstance(data, dict) else {}

    async def _call_once(
        self, path: str, params: Mapping[str, str], group: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        await self._http.pace(group)
        if body is None:
            response = await self._http.send("GET", path, params=params, auth=self._auth)
        else:
            response = await self._http.send("POST", path, json=body, auth=self._auth)
        body = json_body(response)
        if response.is_success and body.get("code") == 0:
            return body
        raise self._failure(path, response, body)

    async def _tenant_token(self, rejected: str | None = None) -> str:
        """The cached token, or a new one when it is near expiry or was ``rejected``. Under a lock, so
        concurrent calls share one token request; a call that finds the rejected token already
        replaced uses the replacement."""
        async with self._token_lock:
            cached = self._token
            if (
                cached is not None
                and cached.value != rejected
                and time.monotonic() < cached.expires_at - self._margin_s
            ):
                return cached.value
            body = await self._http.retrying(self._request_token, "tenant_access_token")
            value, expire = body.get("tenant_access_token"), body.get("expire")
            if not isinstance(value, str) or not value or not isinstance(expire, int | float):
                raise FeishuAuthError("tenant_access_token: the answer has no token and expire", retryable=False)
            self._issued.add(value)
            self._token = _Token(value, time.monotonic() + float(expire))
            return value

    async def _request_token(self) -> dict[str, Any]:
        payload = {"app_id": self._app_id, "app_secret": self._app_secret.get_secret_value()}
        response = await self._http.send(
            "POST", TOKEN_PATH, json=payload, headers={"Content-Type": "application/json; charset=utf-8"}
        )
        body = json_body(response)
        if response.is_success and body.get("code") == 0:
            return body  # the token sits at the top level, not in data (§2.1)
        failure = self._failure(TOKEN_PATH, response, body)
        if isinstance(failure, Transient):
            raise failure
        raise FeishuAuthError(
            f"no tenant token for app {self._app_id}: {failure}",
            status=failure.status,
            code=failure.code,
            retryable=False,
        )

    def _failure(self, path: str, response: httpx.Response, body: dict[str, Any]) -> FeishuError | Transient:
        """The error of an unsuccessful answer: transient ones wrapped for the retry loop."""
        code = body.get("code") if isinstance(body.get("code"), int) else None
        message = str(body.get("msg") or response.reason_phrase or "no message")
        status = response.status_code
        text = self.redact(f"{path}: HTTP {status} code {code if code is not None else '-'}: {message}")
        if status == 429 or code == RATE_LIMITED_CODE:
            wait = platform_wait(response, "x-ogw-ratelimit-reset")
            return Transient(FeishuError(text, status=status, code=code, retryable=True), wait)
        if status >= 500 or status == 408:
            return Transient(FeishuError(text, status=status, code=code, retryable=True))
        return FeishuError(text, status=status, code=code, retryable=False)


class FeishuConfig(BaseModel):
    """The keys of a ``feishu`` connection's config this connector reads (others, such as
    ``chunking``, belong to the pipeline)."""

    # Ignore the pipeline's keys; take space ids given as JSON numbers as the strings they are.
    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)

    base_url: str = Field(default=FEISHU_BASE_URL, description="open.feishu.cn, open.larksuite.com or a stand-in")
    space_ids: list[str] | None = Field(default=None, description="Only these spaces; unset: every space of the app")
    content_format: Literal["markdown", "plain"] = "markdown"
    web_url: str | None = Field(default=None, description="Base of document links, e.g. https://acme.feishu.cn")

    def link_base(self) -> str:
        """Where ``/wiki/<node_token>`` opens. ASSUMPTION: the bare product domain redirects to the
        tenant's; a tenant's own domain in ``web_url`` is better."""
        if self.web_url:
            return self.web_url.rstrip("/")
        return "https://www.larksuite.com" if "larksuite" in self.base_url else "https://www.feishu.cn"


def connection_client(
    connection_id: str,
    config: Mapping[str, Any],
    credentials: Mapping[str, SecretStr],
    *,
    platform: str = "feishu",
    **client: Any,
) -> tuple[FeishuClient, FeishuConfig]:
    """The client and settings of a stored connection; ``ValueError`` (naming fields, never values of
    secrets) when the config or credentials cannot make one. A ``lark`` connection defaults to the
    Lark host. ``client``: FeishuClient options."""
    missing = [field for field in ("app_id", "app_secret") if not credentials.get(field)]
    if missing:
        raise ValueError(f"{platform} connection {connection_id} needs credentials {', '.join(missing)}")
    defaults = {"base_url": LARK_BASE_URL} if platform == "lark" else {}
    try:
        settings = FeishuConfig.model_validate({**defaults, **config})
    except ValidationError as error:
        fields = ", ".join(".".join(str(part) for part in item["loc"]) for item in error.errors())
        raise ValueError(f"{platform} connection {connection_id}: invalid config ({fields})") from None
    feishu = FeishuClient(
        credentials["app_id"].get_secret_value(), credentials["app_secret"], base_url=settings.base_url, **client
    )
    return feishu, settings


@dataclass(frozen=True, slots=True)
class _Space:
    space_id: str
    name: str


class FeishuConnector:
    """The docx pages of a connection's wiki spaces; ``platform`` ``lark`` is the same API on Lark's host.

    ``external_id`` is ``<space_id>/<node_token>``: stable across edits and renames, and ordered by a
    walk that takes the spaces in ascending ``space_id + "/"`` order and, within a space, sorts the
    nodes it collected. Every id of one space starts with that space's prefix, so the concatenation
    is in ascending order overall, as a resumed walk needs, while only one space's nodes are held in
    memory (the tree walk itself returns nodes in tree order, not id order). A page moved to another
    space gets a new id: it is deleted and indexed again.

    ``source_version`` is the node's ``obj_edit_time`` (with the content format, so switching formats
    downloads everything again): an unchanged page costs no content call. ACL: None. Wiki space and
    document members are separate APIs not covered by docs/platform-apis.md, one call per document, so the
    connection's own visibility applies (the app sees what it was granted).
    """

    def __init__(
        self,
        connection_id: str,
        name: str,
        client: FeishuClient,
        settings: FeishuConfig | None = None,
        *,
        platform: str = "feishu",
    ) -> None:
        self.connection_id = connection_id
        self.name = name
        self.platform = platform
        # Not named ``config``: that attribute would make the fetch stage store it (ConfiguredConnector).
        self.settings = settings or FeishuConfig()
        self._client = client

    @classmethod
    def from_connection(
        cls,
        connection_id: str,
        name: str,
        config: Mapping[str, Any],
        credentials: Mapping[str, SecretStr],
        *,
        platform: str = "feishu",
        **client: Any,
    ) -> FeishuConnector:
        """Build from a stored connection (``connection_client``). ``client``: FeishuClient options (tests)."""
        feishu, settings = connection_client(connection_id, config, credentials, platform=platform, **client)
        return cls(connection_id, name, feishu, settings, platform=platform)

    @property
    def media_type(self) -> str:
        return "text/markdown" if self.settings.content_format == "markdown" else "text/plain"

    async def aclose(self) -> None:
        """Close the HTTP connections; the next call opens new ones."""
        await self._client.aclose()

    async def list_items(self) -> AsyncIterator[SourceItem]:
        for space in sorted(await self._spaces(), key=lambda space: space.space_id + "/"):
            items = [item async for item in self._space_items(space)]
            items.sort(key=lambda item: item.external_id)
            for item in items:
                yield item

    async def _spaces(self) -> list[_Space]:
        if self.settings.space_ids is not None:
            spaces = []
            for space_id in self.settings.space_ids:
                space = await self._client.space(space_id)
                spaces.append(_Space(space_id, str(space.get("name") or space_id)))
            return spaces
        return [
            _Space(str(space["space_id"]), str(space.get("name") or space["space_id"]))
            async for space in self._client.spaces()
            if space.get("space_id")
        ]

    async def _space_items(self, space: _Space) -> AsyncIterator[SourceItem]:
        """Breadth first over the tree; ``seen`` guards against a node listed twice (a cycle)."""
        parents: deque[str | None] = deque([None])
        seen: set[str] = set()
        skipped = 0
        while parents:
            async for node in self._client.nodes(space.space_id, parents.popleft()):
                token = str(node.get("node_token") or "")
                if not token or token in seen:
                    continue
                seen.add(token)
                if node.get("node_type") == "shortcut":
                    continue  # the origin is listed in its own space; its children are the origin's
                if node.get("has_child"):
                    parents.append(token)
                if node.get("obj_type") != "docx" or not node.get("obj_token"):
                    skipped += 1
                    continue
                yield self._item(space, node)
        if skipped:
            logger.info("feishu space %s: %d nodes that are not docx documents skipped", space.space_id, skipped)

    def _item(self, space: _Space, node: Mapping[str, Any]) -> SourceItem:
        token, obj_token = str(node["node_token"]), str(node["obj_token"])
        url = f"{self.settings.link_base()}/wiki/{token}"
        edited = node.get("obj_edit_time")
        metadata: dict[str, str | int | float | bool] = {
            "space_id": space.space_id,
            "node_token": token,
            "obj_token": obj_token,
            "obj_type": str(node.get("obj_type")),
        }
        if node.get("owner"):
            metadata["owner"] = str(node["owner"])
        return SourceItem(
            external_id=f"{space.space_id}/{token}",
            title=str(node.get("title") or obj_token),
            source=url,
            media_type=self.media_type,
            source_version=f"{self.settings.content_format}:{edited}" if edited else None,
            knowledge_base=space.name,
            url=url,
            metadata=metadata,
        )

    async def fetch(self, item: SourceItem) -> bytes:
        document_id = str(item.metadata["obj_token"])
        try:
            if self.settings.content_format == "markdown":
                text = await self._client.markdown(document_id)
            else:
                text = await self._client.raw_content(document_id)
        except FeishuAuthError:
            raise  # no token at all: nothing else can be read either, so the sync fails
        except FeishuError as error:
            if error.gone:
                raise DocumentVanished(item.external_id) from None
            if error.denied:
                raise DocumentUnreadable(
                    "permission_denied",
                    f"the Feishu app may not read this document ({error}); add the app to the document or"
                    " its wiki space, and grant it the content scope",
                    retryable=False,
                ) from None
            code = "platform_unavailable" if error.retryable else "platform_error"
            raise DocumentUnreadable(code, str(error), retryable=error.retryable) from None
        return text.encode()
