"""A local Feishu / Lark open platform (docs/platform-apis.md §2.7) over real HTTP, with faults tests can inject.

It serves what the wiki connector calls: the tenant token (top-level token and ``expire``, the
30-minute reissue rule with two valid tokens), wiki spaces, a space, its node tree (opaque
``page_token``, ``page_size`` capped at 50, pages that may be empty while ``has_more`` is true), and a
docx page's Markdown (``docs/v1/content``) or plain text (``docx/v1/.../raw_content``). Limits follow
§2.6: per-app, per-API sliding windows answered with HTTP 429, both ``x-ogw-ratelimit-*`` headers and
code 99991400.

Behaviour the sources do not document is chosen here and labelled ASSUMPTION, so a test never
mistakes it for a fact about the real service.

Use the ``fake_feishu`` fixture (register with ``pytest_plugins = ["tests.support.fake_feishu"]``) or
``run_fake_feishu()`` as a context manager.
"""

from __future__ import annotations

import itertools
import math
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.http_server import serve_in_thread

__all__ = [
    "DEFAULT_APP_ID",
    "DEFAULT_APP_SECRET",
    "FakeFeishu",
    "FakeNode",
    "FakeSpace",
    "create_app",
    "fake_feishu",
    "fake_feishu_server",
    "run_fake_feishu",
]

DEFAULT_APP_ID = "cli_fake0123456789"
DEFAULT_APP_SECRET = "fake-feishu-secret-0123456789abcdef"

TOKEN_PATH = "/open-apis/auth/v3/tenant_access_token/internal"
SEARCH_PATH = "/open-apis/search/v2/doc_wiki/search"
#: §2.4: a unified-search query longer than 30 characters fails validation with 99992402.
MAX_SEARCH_QUERY = 30
MAX_PAGE_SIZE = 50
DEFAULT_PAGE_SIZE = 20

#: §2.6: wiki lists 100/min, docs/v1/content 5/s. ASSUMPTION: raw_content shares the docx 5/s, and
#: unified search the wiki lists' 100/min.
DEFAULT_LIMITS: dict[str, tuple[int, float]] = {"wiki": (100, 60.0), "content": (5, 1.0)}


@dataclass
class FakeNode:
    """One wiki node; ``content`` is the page's Markdown (docx only)."""

    space_id: str
    node_token: str
    obj_token: str
    obj_type: str
    title: str
    parent_node_token: str = ""
    content: str = ""
    node_type: str = "origin"
    obj_edit_time: int = 0
    owner: str = "ou_fakeowner"
    #: The app may not read this document's content.
    denied: bool = False

    def as_json(self, has_child: bool) -> dict[str, Any]:
        """The node as the API shows it: ids and Unix times as strings (§2.2)."""
        return {
            "space_id": self.space_id,
            "node_token": self.node_token,
            "obj_token": self.obj_token,
            "obj_type": self.obj_type,
            "parent_node_token": self.parent_node_token,
            "node_type": self.node_type,
            "origin_node_token": self.node_token,
            "origin_space_id": self.space_id,
            "has_child": has_child,
            "title": self.title,
            "obj_create_time": str(self.obj_edit_time),
            "obj_edit_time": str(self.obj_edit_time),
            "node_create_time": str(self.obj_edit_time),
            "creator": self.owner,
            "owner": self.owner,
            "node_creator": self.owner,
        }


@dataclass
class FakeSpace:
    space_id: str
    name: str
    #: With a tenant token the app sees a space only as a member (§2.2).
    member: bool = True
    nodes: dict[str, FakeNode] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    """One injected error answer for requests whose path starts with ``path``."""

    path: str
    status: int
    code: int
    msg: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeFeishu:
    """State, knobs and counters of one fake server; ``base_url`` is set once it listens. Knobs may be
    set from the test thread between requests; everything is read and written under ``lock``."""

    app_id: str = DEFAULT_APP_ID
    app_secret: str = DEFAULT_APP_SECRET
    base_url: str = ""
    #: Seconds a token lives (7200 at the platform; tests shorten it).
    token_lifetime_s: float = 7200.0
    #: With less than this left, a token request gets a new token and the old one stays valid (§2.1).
    reissue_window_s: float = 1800.0
    #: Per API group: (requests, per seconds).
    limits: dict[str, tuple[int, float]] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    #: ASSUMPTION (where the platform filters a page by permission after paging): every listing's
    #: first page comes back empty with ``has_more`` true.
    empty_first_pages: bool = False
    #: ASSUMPTION, test-only: echo a wrong app secret in the error message, as careless servers do,
    #: to check that the client redacts it.
    echo_secret_in_errors: bool = False
    spaces: dict[str, FakeSpace] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    token_requests: int = 0
    rate_limited: int = 0
    faults: deque[Fault] = field(default_factory=deque)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _calls: dict[str, deque[float]] = field(default_factory=dict)
    _pages: dict[str, tuple[str, int]] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    # -- content -----------------------------------------------------------------------------

    def add_space(self, name: str, *, member: bool = True) -> FakeSpace:
        with self.lock:
            space_id = str(7_000_000_000_000_000_000 + next(self._ids))
            space = self.spaces[space_id] = FakeSpace(space_id, name, member)
            return space

    def add_node(
        self,
        space: FakeSpace,
        title: str,
        content: str = "",
        *,
        parent: FakeNode | None = None,
        obj_type: str = "docx",
        node_type: str = "origin",
    ) -> FakeNode:
        with self.lock:
            number = next(self._ids)
            # Random tokens of 27 characters like the real ones, so creation order is not id order.
            node = FakeNode(
                space_id=space.space_id,
                node_token=f"wik{secrets.token_hex(12)}",
                obj_token=f"dox{secrets.token_hex(12)}",
                obj_type=obj_type,
                title=title,
                parent_node_token=parent.node_token if parent else "",
                content=content,
                node_type=node_type,
                obj_edit_time=1_700_000_000 + number,
            )
            space.nodes[node.node_token] = node
            return node

    def edit(self, node: FakeNode, content: str) -> None:
        with self.lock:
            node.content = content
            node.obj_edit_time += 1000

    def delete(self, node: FakeNode) -> None:
        """Remove the node (and its document) from its space."""
        with self.lock:
            del self.spaces[node.space_id].nodes[node.node_token]

    # -- faults ------------------------------------------------------------------------------

    def expire_tokens(self) -> None:
        """Every token issued so far stops working, as when its lifetime ends."""
        with self.lock:
            self.tokens.clear()

    def throttle_next(self, n: int = 1, *, path: str = "/open-apis/", reset_s: int = 1) -> None:
        """The next ``n`` matching requests answer HTTP 429 with 99991400 and both headers (§2.6)."""
        headers = {"x-ogw-ratelimit-limit": "100", "x-ogw-ratelimit-reset": str(reset_s)}
        with self.lock:
            self.faults.extend(Fault(path, 429, 99991400, "request trigger frequency limit", headers) for _ in range(n))

    def fail_next(self, n: int = 1, *, path: str = "/open-apis/", status: int = 500, code: int = 1500) -> None:
        """The next ``n`` matching requests answer this error (1500 "internal error": generic code page)."""
        with self.lock:
            self.faults.extend(Fault(path, status, code, "internal error") for _ in range(n))

    def reset(self) -> None:
        with self.lock:
            self.token_lifetime_s, self.reissue_window_s = 7200.0, 1800.0
            self.limits = dict(DEFAULT_LIMITS)
            self.empty_first_pages = self.echo_secret_in_errors = False
            self.spaces.clear()
            self.tokens.clear()
            self.requests.clear()
            self.faults.clear()
            self._calls.clear()
            self._pages.clear()
            self.token_requests = self.rate_limited = 0

    # -- views for assertions ----------------------------------------------------------------

    def paths(self, prefix: str = "") -> list[str]:
        with self.lock:
            return [path for _, path, _ in self.requests if path.startswith(prefix)]

    def content_requests(self) -> list[str]:
        """The document ids whose content was read, in order."""
        with self.lock:
            read = []
            for _, path, query in self.requests:
                if path == "/open-apis/docs/v1/content":
                    read.append(query.get("doc_token", ""))
                elif match := re.fullmatch(r"/open-apis/docx/v1/documents/([^/]+)/raw_content", path):
                    read.append(match.group(1))
            return read

    # -- used by the app ---------------------------------------------------------------------

    def issue_token(self) -> tuple[str, int]:
        """The newest token while it has at least ``reissue_window_s`` left, else a new one (§2.1)."""
        now = time.monotonic()
        with self.lock:
            self.token_requests += 1
            if self.tokens:
                token, expires = max(self.tokens.items(), key=lambda pair: pair[1])
                if expires - now >= self.reissue_window_s:
                    return token, math.floor(expires - now)
            token = f"t-{secrets.token_hex(16)}"
            self.tokens[token] = now + self.token_lifetime_s
            return token, math.floor(self.token_lifetime_s)

    def token_valid(self, token: str) -> bool:
        with self.lock:
            expires = self.tokens.get(token)
            return expires is not None and expires > time.monotonic()

    def take_fault(self, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if path.startswith(fault.path):
                    self.faults.remove(fault)
                    return fault
            return None

    def over_limit(self, group: str) -> float | None:
        """Seconds until the window has room, when this call does not fit; else the call is counted."""
        requests, per_s = self.limits[group]
        now = time.monotonic()
        with self.lock:
            calls = self._calls.setdefault(group, deque())
            while calls and now - calls[0] >= per_s:
                calls.popleft()
            if len(calls) >= requests:
                self.rate_limited += 1
                return per_s - (now - calls[0])
            calls.append(now)
            return None

    def page(self, key: str, items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any] | JSONResponse:
        """One page of ``items``: opaque tokens, a first page left empty when asked to."""
        try:
            size = int(query.get("page_size") or DEFAULT_PAGE_SIZE)
        except ValueError:
            size = 0
        if not 1 <= size <= MAX_PAGE_SIZE:
            # ASSUMPTION: an out-of-range page_size answers "field validation failed" (§2.6 code).
            return _error(400, 99992402, "field validation failed")
        with self.lock:
            start = 0
            if token := query.get("page_token"):
                if token not in self._pages or self._pages[token][0] != key:
                    # ASSUMPTION: an unknown page_token is a field validation failure too.
                    return _error(400, 99992402, "field validation failed")
                start = self._pages.pop(token)[1]
            elif self.empty_first_pages:
                following = secrets.token_urlsafe(12)
                self._pages[following] = (key, 0)
                return {"items": [], "has_more": True, "page_token": following}
            stop = start + size
            data: dict[str, Any] = {"items": items[start:stop], "has_more": stop < len(items)}
            if data["has_more"]:
                following = secrets.token_urlsafe(12)
                self._pages[following] = (key, stop)
                data["page_token"] = following
            return data


def _error(status: int, code: int, msg: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": code, "msg": msg, "data": {}}, status_code=status, headers=headers)


def _highlight(text: str, query: str) -> str:
    return re.sub(re.escape(query), lambda match: f"<h>{match.group(0)}</h>", text, flags=re.I) if query else text


def _around(content: str, query: str, width: int = 80) -> str:
    """The content around the query's first match (its start when it has none), on one line."""
    at = content.lower().find(query.lower()) if query else -1
    start = max(at - width, 0) if at >= 0 else 0
    return " ".join(content[start : start + 2 * width + len(query)].split())


def _ok(data: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"code": 0, "msg": "success", "data": data})


def _plain(markdown: str) -> str:
    """The plain text of a page: its Markdown without heading and list marks."""
    return re.sub(r"^(#{1,6}\s+|[-*]\s+)", "", markdown, flags=re.MULTILINE)


def create_app(fake: FakeFeishu) -> FastAPI:
    """Build the ASGI app serving ``fake``'s behaviour."""
    app = FastAPI(title="fake Feishu")

    def gate(request: Request, group: str) -> JSONResponse | None:
        """Record the request; apply auth, injected faults and the rate windows."""
        path = request.url.path
        with fake.lock:
            fake.requests.append((request.method, path, dict(request.query_params)))
        presented = request.headers.get("authorization", "")
        if not presented.startswith("Bearer "):
            # ASSUMPTION: status and code of a missing token are undocumented (§7); 99991661.
            return _error(400, 99991661, "Missing access token for authorization")
        if not fake.token_valid(presented.removeprefix("Bearer ").strip()):
            # ASSUMPTION: the HTTP status of an invalid token is undocumented (§7); 400 with 99991663.
            return _error(
                400, 99991663, "Invalid access token for authorization. Please make a request with token attached."
            )
        if fault := fake.take_fault(path):
            return _error(fault.status, fault.code, fault.msg, fault.headers)
        wait = fake.over_limit(group)
        if wait is not None:
            limit = fake.limits[group][0]
            headers = {"x-ogw-ratelimit-limit": str(limit), "x-ogw-ratelimit-reset": str(max(math.ceil(wait), 1))}
            return _error(429, 99991400, "request trigger frequency limit", headers)
        return None

    def visible(space_id: str) -> FakeSpace | JSONResponse:
        space = fake.spaces.get(space_id)
        if space is None or not space.member:
            # ASSUMPTION: a space the app is no member of answers 131006 (third-party reports) with 400.
            return _error(400, 131006, "permission denied: wiki space permission denied")
        return space

    def space_json(space: FakeSpace) -> dict[str, Any]:
        return {
            "name": space.name,
            "description": "",
            "space_id": space.space_id,
            "space_type": "team",
            "visibility": "private",
        }

    @app.post(TOKEN_PATH)
    async def tenant_access_token(request: Request) -> JSONResponse:
        with fake.lock:
            fake.requests.append((request.method, request.url.path, {}))
        try:
            body: Any = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("app_id") != fake.app_id or body.get("app_secret") != fake.app_secret:
            # ASSUMPTION: the answer to a wrong app id or secret is not in our sources; 10014 with 400.
            shown = f": {body.get('app_secret')}" if fake.echo_secret_in_errors and isinstance(body, dict) else ""
            return _error(400, 10014, f"app secret invalid{shown}")
        if fault := fake.take_fault(TOKEN_PATH):
            return _error(fault.status, fault.code, fault.msg, fault.headers)
        token, expire = fake.issue_token()
        return JSONResponse({"code": 0, "msg": "ok", "tenant_access_token": token, "expire": expire})

    @app.get("/open-apis/wiki/v2/spaces")
    async def list_spaces(request: Request) -> JSONResponse:
        if failed := gate(request, "wiki"):
            return failed
        with fake.lock:
            items = [space_json(space) for space in fake.spaces.values() if space.member]
        data = fake.page("spaces", items, dict(request.query_params))
        return data if isinstance(data, JSONResponse) else _ok(data)

    @app.get("/open-apis/wiki/v2/spaces/{space_id}")
    async def get_space(space_id: str, request: Request) -> JSONResponse:
        if failed := gate(request, "wiki"):
            return failed
        with fake.lock:
            space = visible(space_id)
            return space if isinstance(space, JSONResponse) else _ok({"space": space_json(space)})

    @app.get("/open-apis/wiki/v2/spaces/{space_id}/nodes")
    async def list_nodes(space_id: str, request: Request) -> JSONResponse:
        if failed := gate(request, "wiki"):
            return failed
        query = dict(request.query_params)
        parent = query.get("parent_node_token", "")
        with fake.lock:
            space = visible(space_id)
            if isinstance(space, JSONResponse):
                return space
            parents = {node.parent_node_token for node in space.nodes.values()}
            items = [
                node.as_json(node.node_token in parents)
                for node in space.nodes.values()
                if node.parent_node_token == parent
            ]
        data = fake.page(f"nodes:{space_id}:{parent}", items, query)
        return data if isinstance(data, JSONResponse) else _ok(data)

    def document(document_id: str) -> FakeNode | JSONResponse:
        with fake.lock:
            node = next(
                (
                    node
                    for space in fake.spaces.values()
                    for node in space.nodes.values()
                    if node.obj_token == document_id
                ),
                None,
            )
        if node is None:
            # ASSUMPTION: a deleted document answers 404 with 1770002 (docx "not found").
            return _error(404, 1770002, "not found")
        if node.denied:
            # ASSUMPTION: a document the app may not read answers 403 with 1770032 "forBidden", as
            # third-party reports show for the docx API.
            return _error(403, 1770032, "forBidden")
        return node

    @app.post(SEARCH_PATH)
    async def unified_search(request: Request) -> JSONResponse:
        """Unified search with the app's tenant token (§2.4): docx pages of the spaces the app is a
        member of whose title or content holds the query, case-insensitively. ASSUMPTION (shapes from
        the official SDK's models, ranking and highlighting undocumented): title matches first, the
        match wrapped in ``<h>``, a summary of the content around it, ``page_token`` an offset."""
        if failed := gate(request, "wiki"):
            return failed
        try:
            body: Any = await request.json()
        except ValueError:
            body = None
        query = body.get("query") if isinstance(body, dict) else None
        size = body.get("page_size", DEFAULT_PAGE_SIZE) if isinstance(body, dict) else None
        if not isinstance(query, str) or len(query) > MAX_SEARCH_QUERY or not isinstance(size, int):
            return _error(400, 99992402, "field validation failed")
        size = min(max(size, 1), MAX_PAGE_SIZE)
        spaces = ((body.get("wiki_filter") or {}).get("space_ids")) if isinstance(body, dict) else None
        needle = query.lower()
        with fake.lock:
            found = [
                node
                for space in fake.spaces.values()
                if space.member and (not spaces or space.space_id in spaces)
                for node in space.nodes.values()
                if node.obj_type == "docx" and (needle in node.title.lower() or needle in node.content.lower())
            ]
        found.sort(key=lambda node: (needle not in node.title.lower(), node.title))
        start = int(body.get("page_token") or 0) if str(body.get("page_token") or "0").isdigit() else 0
        page = found[start : start + size]
        units = [
            {
                "title_highlighted": _highlight(node.title, query),
                "summary_highlighted": _highlight(_around(node.content, query), query),
                "entity_type": "WIKI",
                "result_meta": {
                    "token": node.node_token,
                    "url": f"https://fake.feishu.cn/wiki/{node.node_token}",
                    "doc_types": "DOCX",
                    "update_time": node.obj_edit_time,
                    "owner_id": node.owner,
                },
            }
            for node in page
        ]
        more = start + size < len(found)
        return _ok({"total": len(found), "has_more": more, "res_units": units, "page_token": str(start + size)})

    @app.get("/open-apis/docs/v1/content")
    async def markdown_content(request: Request) -> JSONResponse:
        if failed := gate(request, "content"):
            return failed
        query = dict(request.query_params)
        if query.get("doc_type") != "docx" or query.get("content_type") != "markdown":
            return _error(400, 99992402, "field validation failed")  # docx only (§2.3)
        node = document(query.get("doc_token", ""))
        if isinstance(node, JSONResponse):
            return node
        return _ok({"content": node.content})

    @app.get("/open-apis/docx/v1/documents/{document_id}/raw_content")
    async def raw_content(document_id: str, request: Request) -> JSONResponse:
        if failed := gate(request, "content"):
            return failed
        node = document(document_id)
        if isinstance(node, JSONResponse):
            return node
        return _ok({"content": _plain(node.content)})

    return app


@contextmanager
def run_fake_feishu() -> Iterator[FakeFeishu]:
    """Serve a fresh fake on 127.0.0.1 in a background thread for the duration of the block."""
    fake = FakeFeishu()
    with serve_in_thread(create_app(fake), "fake-feishu") as base_url:
        fake.base_url = base_url
        yield fake


@pytest.fixture(scope="session")
def fake_feishu_server() -> Iterator[FakeFeishu]:
    """One server per test session: starting uvicorn per test would dominate the tests' time."""
    with run_fake_feishu() as fake:
        yield fake


@pytest.fixture
def fake_feishu(fake_feishu_server: FakeFeishu) -> Iterator[FakeFeishu]:
    """The session's fake with its content, knobs and counters reset."""
    fake_feishu_server.reset()
    yield fake_feishu_server
    fake_feishu_server.reset()
