"""Yuque (语雀) connector: the docs of knowledge repos (books), read as Markdown through OpenAPI v2.

Vendor facts are in ``docs/platform-apis.md`` (Yuque); where it is silent the choice is marked
ASSUMPTION here and in ``tests/support/fake_yuque.py``.

- **Auth:** the personal token as ``X-Auth-Token``, and a ``User-Agent`` on every request (the
  platform refuses requests without one). ``base_url`` is the host (``https://www.yuque.com`` or an
  enterprise space's own, ``https://acme.yuque.com``); the client adds ``/api/v2``.
- **Listing:** the configured ``repos`` (namespaces ``group/book``), else every Book repo of the
  token's user and of the user's groups (``GET /user``, ``/users/:id/groups``: routes of the same v2
  API). Lists are paged with ``offset`` and ``limit`` 100; a doc list ends at ``meta.total`` or an
  empty page, a repo or group list (no total) at a short page. Each repo's TOC gives a document its
  path of parent titles.
- **Content:** ``GET /repos/:namespace/docs/:id``: the Markdown ``body``; when it is empty,
  ``body_html`` converted with markdownify, then the lake format's ``body_lake`` the same way.
- **Limits and errors:** ASSUMPTION: the official rate limits are undocumented; a client-side pace of
  ``YuqueLimits.api`` keeps well under the third-party "100 QPS". HTTP 429 waits what ``Retry-After``
  or ``X-RateLimit-Reset`` says, 5xx and network failures back off. 401 (the token is refused) fails
  the sync; 403 on one document fails that document alone, 404 means it is gone. A listing that fails
  fails the sync, because a partial listing would delete what it missed.

The token never reaches a message: server text is redacted and httpx errors are never chained.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.vendor_http import RateLimit, RetryPolicy, Transient, VendorError, VendorHttp, json_body
from ragstream.vendor_http import retry_after as platform_wait

__all__ = [
    "USER_AGENT",
    "YUQUE_BASE_URL",
    "YuqueAuthError",
    "YuqueClient",
    "YuqueConfig",
    "YuqueConnector",
    "YuqueError",
    "YuqueLimits",
    "acl_for",
    "doc_markdown",
]

logger = logging.getLogger(__name__)

YUQUE_BASE_URL = "https://www.yuque.com"
API_PREFIX = "/api/v2"
USER_AGENT = "ragstream-connector/1.0"

#: ``limit`` maximum of every list (and the default).
PAGE_SIZE = 100
#: Repo ``public`` values (the v2 spec): 0 private, 1 public, 2 public inside the enterprise space.
PRIVATE, PUBLIC, ENTERPRISE_PUBLIC = 0, 1, 2
#: A document body longer than this is refused before any conversion (a parser's size budget).
MAX_BODY_CHARS = 20_000_000
#: ``q`` of ``GET /search`` is at most this long.
MAX_SEARCH_CHARS = 200

_NAMESPACE = re.compile(r"^[^/\s]+/[^/\s]+$")


class YuqueError(VendorError):
    """What the platform answered (HTTP ``status`` and its message), without the token."""

    @property
    def denied(self) -> bool:
        return self.status == 403

    @property
    def gone(self) -> bool:
        return self.status == 404


class YuqueAuthError(YuqueError):
    """HTTP 401: the token is wrong, expired or lacks the scope. Nothing can be read, so it fails the
    sync rather than each document."""


@dataclass(frozen=True, slots=True)
class YuqueLimits:
    """Client-side pacing. ASSUMPTION: no official limit is published; 20 calls a second."""

    api: RateLimit = field(default_factory=lambda: RateLimit(20, 1.0))


def acl_for(namespace: str, repo_public: object, doc_public: object) -> tuple[str, ...] | None:
    """The ACL of a document: public (1) and enterprise-public (2) ones are readable by everyone who
    can see the connection (None); a private repo or a private document in it (0) only by principals
    holding the group ``yuque:<namespace>``, since the repo's member list is not read. A ``public``
    that is missing or unknown counts as private."""
    readable = (PUBLIC, ENTERPRISE_PUBLIC)
    if repo_public in readable and doc_public in readable:
        return None
    return (f"group:yuque:{namespace}",)


class YuqueClient:
    """The v2 calls the connector makes, with pacing and retries; the HTTP pool is opened on first use
    and closed by ``aclose``."""

    def __init__(
        self,
        token: SecretStr,
        *,
        base_url: str = YUQUE_BASE_URL,
        user_agent: str = USER_AGENT,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        limits: YuqueLimits | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not token.get_secret_value():
            raise ValueError("a Yuque client needs a token")
        self._token = token
        self._http = VendorHttp(
            "yuque",
            base_url.rstrip("/") + API_PREFIX,
            timeout_s=timeout_s,
            headers={"X-Auth-Token": token.get_secret_value(), "User-Agent": user_agent},
            limits={"api": (limits or YuqueLimits()).api},
            retry=retry,
            transport=transport,
            secrets=lambda: [self._token.get_secret_value()],
            error_type=YuqueError,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def user(self) -> dict[str, Any]:
        """The token's own user (``id``, ``login``)."""
        data = await self._get("/user")
        if not isinstance(data, dict):
            raise YuqueError("/user: the answer has no data", retryable=False)
        return data

    def groups(self, user_id: object) -> AsyncIterator[dict[str, Any]]:
        return self._pages(f"/users/{user_id}/groups", {})

    def repos(self, kind: str, login: str) -> AsyncIterator[dict[str, Any]]:
        """The Book repos of a ``users`` or ``groups`` login."""
        return self._pages(f"/{kind}/{quote(login, safe='')}/repos", {"type": "Book"})

    async def repo(self, namespace: str) -> dict[str, Any]:
        data = await self._get(f"/repos/{namespace}")
        if not isinstance(data, dict):
            raise YuqueError(f"repo {namespace}: the answer has no data", retryable=False)
        return data

    def docs(self, namespace: str) -> AsyncIterator[dict[str, Any]]:
        return self._pages(f"/repos/{namespace}/docs", {})

    async def toc(self, namespace: str) -> list[dict[str, Any]]:
        data = await self._get(f"/repos/{namespace}/toc")
        return [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else []

    async def doc(self, namespace: str, doc_id: str) -> dict[str, Any]:
        data = await self._get(f"/repos/{namespace}/docs/{doc_id}")
        if not isinstance(data, dict):
            raise YuqueError(f"doc {namespace}/{doc_id}: the answer has no data", retryable=False)
        return data

    async def search(self, query: str, *, page: int = 1, scope: str | None = None) -> list[dict[str, Any]]:
        """One page (20, fixed) of the docs matching ``query`` (cut to the documented 200 characters),
        within ``scope`` (a group or ``group/book``) when given."""
        params = {"q": query[:MAX_SEARCH_CHARS], "type": "doc", "page": str(page)}
        if scope is not None:
            params["scope"] = scope
        data = (await self._body("/search", params)).get("data")
        return [hit for hit in data if isinstance(hit, dict)] if isinstance(data, list) else []

    async def create_doc(self, namespace: str, title: str, body: str) -> dict[str, Any]:
        """``POST /repos/:namespace/docs`` with a Markdown ``body``; the created doc (its ``id``,
        ``slug``). Not added to the TOC (the platform leaves that to ``PUT …/toc``)."""
        payload = {"title": title, "body": body, "format": "markdown"}
        return await self._write("POST", f"/repos/{namespace}/docs", payload)

    async def update_doc(self, namespace: str, doc_id: str, body: str, *, title: str | None = None) -> dict[str, Any]:
        """``PUT /repos/:namespace/docs/:id``: the body replaced in full (and the title, when given)."""
        payload: dict[str, Any] = {"body": body, "format": "markdown"}
        if title is not None:
            payload["title"] = title
        return await self._write("PUT", f"/repos/{namespace}/docs/{doc_id}", payload)

    async def _write(self, method: str, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        async def once() -> dict[str, Any]:
            # A create that timed out or failed on the server's side may still have happened: retried,
            # it could make the doc twice. So a POST is retried only after a 429 (refused unprocessed).
            await self._http.pace("api")
            try:
                response = await self._http.send(method, path, json=dict(payload))
            except Transient as unsent:
                if method == "POST":
                    raise unsent.error from None
                raise
            if response.is_success:
                return json_body(response)
            failure = self._failure(path, response)
            if method == "POST" and isinstance(failure, Transient) and response.status_code != 429:
                raise failure.error
            raise failure

        data = (await self._http.retrying(once, path)).get("data")
        if not isinstance(data, dict) or data.get("id") is None:
            raise YuqueError(f"{path}: the answer has no doc", retryable=False)
        return data

    async def _pages(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Every item: ``offset`` moves by the page's length until ``meta.total`` (when the list has
        one) is reached, or a page comes back empty or, without a total, short."""
        offset = 0
        previous: object = None
        while True:
            body = await self._body(path, {**params, "offset": str(offset), "limit": str(PAGE_SIZE)})
            page = body.get("data")
            items = [item for item in page if isinstance(item, dict)] if isinstance(page, list) else []
            if items and offset and items[0].get("id") == previous:
                # The same page again: the offset was ignored, and asking on would never end.
                raise YuqueError(f"{path}: offset {offset} answered the previous page again", retryable=False)
            previous = items[0].get("id") if items else None
            for item in items:
                yield item
            offset += len(items)
            meta = body.get("meta")
            total = meta.get("total") if isinstance(meta, dict) else None
            if not items or (isinstance(total, int) and offset >= total):
                return
            if not isinstance(total, int) and len(items) < PAGE_SIZE:
                return

    async def _get(self, path: str) -> Any:
        return (await self._body(path, {})).get("data")

    async def _body(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        return await self._http.retrying(lambda: self._call_once(path, params), path)

    async def _call_once(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        await self._http.pace("api")
        response = await self._http.send("GET", path, params=params)
        if response.is_success:
            return json_body(response)
        raise self._failure(path, response)

    def _failure(self, path: str, response: httpx.Response) -> YuqueError | Transient:
        """The error of an unsuccessful answer. The error body's shape is undocumented, so only a
        ``message`` string in it is shown, never parsed further."""
        status = response.status_code
        message = json_body(response).get("message")
        shown = message if isinstance(message, str) and message else response.reason_phrase or "no message"
        text = self._http.redact(f"{path}: HTTP {status}: {shown}")
        if status == 429:
            wait = platform_wait(response, "x-ratelimit-reset")
            return Transient(YuqueError(text, status=status, retryable=True), wait)
        if status >= 500 or status == 408:
            return Transient(YuqueError(text, status=status, retryable=True))
        if status == 401:
            return YuqueAuthError(f"the Yuque token was refused ({text})", status=status, retryable=False)
        return YuqueError(text, status=status, retryable=False)


class YuqueConfig(BaseModel):
    """The keys of a ``yuque`` connection's config this connector reads (others, such as ``chunking``,
    belong to the pipeline)."""

    model_config = ConfigDict(extra="ignore")

    base_url: str = Field(default=YUQUE_BASE_URL, description="www.yuque.com or an enterprise space's host")
    repos: list[str] | None = Field(default=None, description="Namespaces group/book; unset: every repo")

    @field_validator("repos")
    @classmethod
    def _namespaces(cls, repos: list[str] | None) -> list[str] | None:
        for namespace in repos or []:
            if not _NAMESPACE.fullmatch(namespace):
                raise ValueError(f"{namespace!r} is not a namespace group/book")
        return repos


@dataclass(frozen=True, slots=True)
class _Repo:
    namespace: str
    name: str
    public: object


class YuqueConnector:
    """The docs of a connection's Yuque repos.

    ``external_id`` is ``<namespace>/<doc id>``: the numeric id survives renames and slug changes; the
    repos are walked in ascending ``namespace + "/"`` order and each repo's docs sorted, so the ids are
    ascending overall while one repo's listing is held in memory. ``title`` is the document's TOC path
    (``Parent > Child > Title``), which the fetched Markdown also starts with as its first heading, so
    every chunk carries it; ``knowledge_base`` is the repo's name.

    ``source_version`` is the doc's ``content_updated_at`` (else ``updated_at``) with its TOC path, so
    an unchanged doc costs no content call and a moved one is read again. ACL: see ``acl_for``.
    """

    platform = "yuque"
    media_type = "text/markdown"

    def __init__(self, connection_id: str, name: str, client: YuqueClient, settings: YuqueConfig | None = None) -> None:
        self.connection_id = connection_id
        self.name = name
        # Not named ``config``: that attribute would make the fetch stage store it (ConfiguredConnector).
        self.settings = settings or YuqueConfig()
        self._client = client

    @classmethod
    def from_connection(
        cls,
        connection_id: str,
        name: str,
        config: Mapping[str, Any],
        credentials: Mapping[str, SecretStr],
        **client: Any,
    ) -> YuqueConnector:
        """Build from a stored connection; ``ValueError`` (naming fields, never values of secrets) when
        the config or credentials cannot make one. ``client``: YuqueClient options (tests)."""
        token = credentials.get("token")
        if token is None or not token.get_secret_value():
            raise ValueError(f"yuque connection {connection_id} needs credentials token")
        try:
            settings = YuqueConfig.model_validate(config)
        except ValidationError as error:
            fields = ", ".join(".".join(str(part) for part in item["loc"]) for item in error.errors())
            raise ValueError(f"yuque connection {connection_id}: invalid config ({fields})") from None
        return cls(connection_id, name, YuqueClient(token, base_url=settings.base_url, **client), settings)

    async def aclose(self) -> None:
        """Close the HTTP connections; the next call opens new ones."""
        await self._client.aclose()

    async def list_items(self) -> AsyncIterator[SourceItem]:
        for repo in sorted(await self._repos(), key=lambda repo: repo.namespace + "/"):
            paths = _toc_paths(await self._client.toc(repo.namespace))
            items = [self._item(repo, doc, paths) async for doc in self._client.docs(repo.namespace) if doc.get("id")]
            items.sort(key=lambda item: item.external_id)
            for item in items:
                yield item

    async def _repos(self) -> list[_Repo]:
        if self.settings.repos is not None:
            repos = []
            for namespace in self.settings.repos:
                repo = await self._client.repo(namespace)
                repos.append(_Repo(namespace, str(repo.get("name") or namespace), repo.get("public")))
            return repos
        user = await self._client.user()
        if not user.get("id"):
            raise YuqueError("/user: the answer has no id", retryable=False)
        owners = [("users", str(user.get("login") or user["id"]))]
        owners += [
            ("groups", str(group.get("login") or group.get("id"))) async for group in self._client.groups(user["id"])
        ]
        found: dict[str, _Repo] = {}
        for kind, login in owners:
            async for repo in self._client.repos(kind, login):
                listed = repo.get("namespace")
                if isinstance(listed, str) and _NAMESPACE.fullmatch(listed):
                    found[listed] = _Repo(listed, str(repo.get("name") or listed), repo.get("public"))
        return list(found.values())

    def _item(self, repo: _Repo, doc: Mapping[str, Any], paths: Mapping[int, list[str]]) -> SourceItem:
        doc_id = int(doc["id"])
        title = str(doc.get("title") or doc.get("slug") or doc_id)
        title_path = " > ".join([*paths.get(doc_id, []), title])
        changed = doc.get("content_updated_at") or doc.get("updated_at")
        url = f"{self.settings.base_url.rstrip('/')}/{repo.namespace}/{doc.get('slug') or doc_id}"
        return SourceItem(
            external_id=f"{repo.namespace}/{doc_id}",
            title=title_path,
            source=url,
            media_type=self.media_type,
            source_version=f"{changed}|{title_path}" if changed else None,
            acl=acl_for(repo.namespace, repo.public, doc.get("public")),
            knowledge_base=repo.name,
            url=url,
            metadata={"namespace": repo.namespace, "doc_id": doc_id, "slug": str(doc.get("slug") or "")},
        )

    async def fetch(self, item: SourceItem) -> bytes:
        namespace, doc_id = str(item.metadata["namespace"]), str(item.metadata["doc_id"])
        try:
            doc = await self._client.doc(namespace, doc_id)
        except YuqueAuthError:
            raise  # the token is refused: nothing else can be read either, so the sync fails
        except YuqueError as error:
            if error.gone:
                raise DocumentVanished(item.external_id) from None
            if error.denied:
                raise DocumentUnreadable(
                    "permission_denied",
                    f"the Yuque token may not read this document ({error}); grant its user the repo",
                    retryable=False,
                ) from None
            code = "platform_unavailable" if error.retryable else "platform_error"
            raise DocumentUnreadable(code, str(error), retryable=error.retryable) from None
        body = await doc_markdown(doc)
        return f"# {item.title}\n\n{body}".encode()


def _toc_paths(toc: list[dict[str, Any]]) -> dict[int, list[str]]:
    """For each doc in the TOC, the titles of the entries above it (TITLE groups and parent docs)."""
    by_uuid = {str(entry["uuid"]): entry for entry in toc if entry.get("uuid")}
    paths: dict[int, list[str]] = {}
    for entry in toc:
        doc_id = entry.get("doc_id") or (entry.get("id") if entry.get("type") == "DOC" else None)
        if not isinstance(doc_id, int):
            continue
        ancestors: list[str] = []
        parent = by_uuid.get(str(entry.get("parent_uuid") or ""))
        while parent is not None and len(ancestors) < len(by_uuid):  # bounded: a cycle cannot loop
            ancestors.append(str(parent.get("title") or ""))
            parent = by_uuid.get(str(parent.get("parent_uuid") or ""))
        paths[doc_id] = [title for title in reversed(ancestors) if title]
    return paths


async def doc_markdown(doc: Mapping[str, Any]) -> str:
    """The doc's Markdown: ``body``, else ``body_html`` or ``body_lake`` converted."""
    for key in ("body", "body_html", "body_lake"):
        text = doc.get(key)
        if not isinstance(text, str) or not text.strip():
            continue
        if len(text) > MAX_BODY_CHARS:
            raise DocumentUnreadable(
                "too_large", f"the {key} has {len(text)} characters, over {MAX_BODY_CHARS}", retryable=False
            )
        if key == "body":
            return text
        return await asyncio.to_thread(_html_to_markdown, text)
    return ""


def _html_to_markdown(html: str) -> str:
    # Imported lazily: markdownify pulls in BeautifulSoup, which only docs without a Markdown body need.
    from markdownify import markdownify

    return re.sub(r"\n{3,}", "\n\n", markdownify(html, heading_style="ATX")).strip()
