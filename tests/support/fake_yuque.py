"""A local Yuque OpenAPI v2 (docs/platform-apis.md, Yuque) over real HTTP, with faults tests can inject.

It serves what the connector calls under ``/api/v2``: the token's user, its groups, the Book repos of
a user or group, one repo, a repo's docs (``offset``/``limit`` ≤ 100, ``meta.total``), its TOC, one
doc with ``body``, ``body_html`` and ``body_lake``, the doc search (pages of 20), and the writes: a
doc created (``POST …/docs``, not added to the TOC) or updated (``PUT …/docs/:id``). Every request
needs ``X-Auth-Token`` (401 otherwise) and a ``User-Agent``; a sliding window and injected faults
answer HTTP 429 with the ``X-RateLimit-*`` headers; a doc the token may not read answers 403, a missing one 404.

Behaviour the sources do not document is chosen here and labelled ASSUMPTION, so a test never
mistakes it for a fact about the real service.

Use the ``fake_yuque`` fixture (register with ``pytest_plugins = ["tests.support.fake_yuque"]``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.http_server import serve_in_thread

__all__ = ["DEFAULT_TOKEN", "FakeDoc", "FakeRepo", "FakeYuque", "create_app", "fake_yuque", "fake_yuque_server"]

DEFAULT_TOKEN = "fake-yuque-token-0123456789abcdef"
MAX_LIMIT = 100
SEARCH_PAGE = 20
USER = {"id": 1001, "login": "ada", "name": "Ada"}


@dataclass
class FakeDoc:
    id: int
    slug: str
    title: str
    body: str = ""
    body_html: str = ""
    body_lake: str = ""
    format: str = "markdown"
    public: int = 1
    updated: int = 0
    #: The uuid of the TOC entry above this doc ("" at the top).
    parent_uuid: str = ""
    #: The token may not read this doc's content.
    denied: bool = False

    def stamp(self) -> str:
        """An ISO-8601 time that moves with ``updated``."""
        return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(1_700_000_000 + self.updated))

    def listed(self, book_id: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "Doc",
            "slug": self.slug,
            "title": self.title,
            "description": "",
            "user_id": USER["id"],
            "book_id": book_id,
            "public": self.public,
            "status": 1,
            "word_count": len(self.body),
            "created_at": "2023-11-14T22:13:20.000Z",
            "updated_at": self.stamp(),
            "content_updated_at": self.stamp(),
            "published_at": self.stamp(),
        }


@dataclass
class FakeRepo:
    id: int
    namespace: str
    name: str
    public: int = 1
    docs: dict[int, FakeDoc] = field(default_factory=dict)
    #: The token may read but not write this repo (a write answers 403).
    read_only: bool = False
    #: TOC entries besides the docs': TITLE groups, uuid → title (and their parent uuid).
    titles: dict[str, tuple[str, str]] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        owner = self.namespace.split("/")[0]
        return {
            "id": self.id,
            "type": "Book",
            "slug": self.namespace.split("/")[1],
            "name": self.name,
            "namespace": self.namespace,
            "public": self.public,
            "items_count": len(self.docs),
            "user": {"login": owner},
        }


@dataclass
class FakeYuque:
    """State, knobs and counters of one fake server; ``base_url`` is set once it listens. Everything
    is read and written under ``lock``."""

    token: str = DEFAULT_TOKEN
    base_url: str = ""
    #: The user's groups (logins); repos of a login outside these and the user are not listed.
    groups: list[str] = field(default_factory=lambda: ["eng"])
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    #: ASSUMPTION: the official limits are undocumented; (requests, per seconds), None: no window.
    limit: tuple[int, float] | None = None
    #: A misbehaving server, test-only: every list answers its first page whatever the offset.
    ignore_offset: bool = False
    #: Seconds every search waits before it answers.
    search_delay_s: float = 0.0
    requests: list[tuple[str, dict[str, str], dict[str, str]]] = field(default_factory=list)
    throttles: deque[int] = field(default_factory=deque)
    rate_limited: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _calls: deque[float] = field(default_factory=deque)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def add_repo(self, namespace: str, name: str, *, public: int = 1) -> FakeRepo:
        with self.lock:
            repo = self.repos[namespace] = FakeRepo(next(self._ids), namespace, name, public)
            return repo

    def add_title(self, repo: FakeRepo, title: str, parent: str = "") -> str:
        """A TOC group (type TITLE); returns its uuid."""
        with self.lock:
            uuid = f"t{next(self._ids)}"
            repo.titles[uuid] = (title, parent)
            return uuid

    def add_doc(self, repo: FakeRepo, title: str, body: str = "", *, parent: str = "", **fields: Any) -> FakeDoc:
        with self.lock:
            number = next(self._ids)
            doc = FakeDoc(
                10_000 + number * 7, f"doc-{number}", title, body, parent_uuid=parent, updated=number, **fields
            )
            repo.docs[doc.id] = doc
            return doc

    def edit(self, doc: FakeDoc, body: str) -> None:
        with self.lock:
            doc.body = body
            doc.updated += 1000

    def delete(self, repo: FakeRepo, doc: FakeDoc) -> None:
        with self.lock:
            del repo.docs[doc.id]

    def throttle_next(self, n: int = 1, *, reset_s: int = 1) -> None:
        """The next ``n`` requests answer 429 with ``X-RateLimit-Reset: reset_s``."""
        with self.lock:
            self.throttles.extend([reset_s] * n)

    def reset(self) -> None:
        with self.lock:
            self.groups = ["eng"]
            self.repos.clear()
            self.limit = None
            self.ignore_offset = False
            self.search_delay_s = 0.0
            self.requests.clear()
            self.throttles.clear()
            self._calls.clear()
            self.rate_limited = 0

    def content_requests(self) -> list[str]:
        """``<namespace>/<doc id>`` of every doc read, in order."""
        with self.lock:
            matches = (re.fullmatch(r"/api/v2/repos/([^/]+/[^/]+)/docs/([^/]+)", path) for path, _, _ in self.requests)
            return [f"{match.group(1)}/{match.group(2)}" for match in matches if match]

    def over_limit(self) -> float | None:
        """Seconds until the window has room, when this call does not fit; else it is counted."""
        if self.limit is None:
            return None
        requests, per_s = self.limit
        now = time.monotonic()
        with self.lock:
            while self._calls and now - self._calls[0] >= per_s:
                self._calls.popleft()
            if len(self._calls) >= requests:
                return per_s - (now - self._calls[0])
            self._calls.append(now)
            return None


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    # ASSUMPTION: the error body's shape is undocumented; {"status", "message"}.
    return JSONResponse({"status": status, "message": message}, status_code=status, headers=headers)


def _page(items: list[dict[str, Any]], query: dict[str, str], *, total: bool, first: bool = False) -> JSONResponse:
    try:
        offset, limit = int(query.get("offset", "0")), int(query.get("limit", str(MAX_LIMIT)))
    except ValueError:
        return _error(400, "invalid parameters")
    if offset < 0 or not 1 <= limit <= MAX_LIMIT:
        # ASSUMPTION: a limit over 100 answers 400 "invalid parameters" (the spec only caps it).
        return _error(400, "invalid parameters")
    if first:
        offset = 0
    body: dict[str, Any] = {"data": items[offset : offset + limit]}
    if total:
        body["meta"] = {"total": len(items)}
    return JSONResponse(body)


def create_app(fake: FakeYuque) -> FastAPI:
    """Build the ASGI app serving ``fake``'s behaviour."""
    app = FastAPI(title="fake Yuque")

    def gate(request: Request) -> JSONResponse | None:
        """Record the request; apply the User-Agent and token checks, injected 429s and the window."""
        with fake.lock:
            fake.requests.append((request.url.path, dict(request.query_params), dict(request.headers)))
        if not request.headers.get("user-agent"):
            # ASSUMPTION: the status for a missing User-Agent is undocumented; 403.
            return _error(403, "User-Agent required")
        if request.headers.get("x-auth-token") != fake.token:
            return _error(401, "token is invalid")
        with fake.lock:
            reset = fake.throttles.popleft() if fake.throttles else None
            wait = None if reset is not None else fake.over_limit()
            if reset is None and wait is None:
                return None
            fake.rate_limited += 1
        seconds = reset if reset is not None else max(math.ceil(wait or 0), 1)
        limit = str(fake.limit[0]) if fake.limit else "5000"
        headers = {"X-RateLimit-Limit": limit, "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(seconds)}
        return _error(429, "访问频率超限", headers)

    def repo_of(group: str, book: str) -> FakeRepo | JSONResponse:
        repo = fake.repos.get(f"{group}/{book}")
        return repo if repo is not None else _error(404, "repo not found")

    @app.get("/api/v2/user")
    async def user(request: Request) -> JSONResponse:
        return gate(request) or JSONResponse({"data": USER})

    @app.get("/api/v2/users/{user_id}/groups")
    async def groups(user_id: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            items = [{"id": 500 + number, "login": login, "name": login} for number, login in enumerate(fake.groups)]
        return _page(items if user_id == str(USER["id"]) else [], dict(request.query_params), total=False)

    async def owned_repos(login: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            owners = {USER["login"], *fake.groups}
            items = [repo.json() for repo in fake.repos.values() if repo.namespace.split("/")[0] == login]
        return _page(items if login in owners else [], dict(request.query_params), total=False)

    @app.get("/api/v2/users/{login}/repos")
    async def user_repos(login: str, request: Request) -> JSONResponse:
        return await owned_repos(login, request)

    @app.get("/api/v2/groups/{login}/repos")
    async def group_repos(login: str, request: Request) -> JSONResponse:
        return await owned_repos(login, request)

    @app.get("/api/v2/repos/{group}/{book}")
    async def get_repo(group: str, book: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            repo = repo_of(group, book)
            return repo if isinstance(repo, JSONResponse) else JSONResponse({"data": repo.json()})

    @app.get("/api/v2/repos/{group}/{book}/docs")
    async def list_docs(group: str, book: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            repo = repo_of(group, book)
            if isinstance(repo, JSONResponse):
                return repo
            items = [doc.listed(repo.id) for doc in sorted(repo.docs.values(), key=lambda doc: -doc.updated)]
        return _page(items, dict(request.query_params), total=True, first=fake.ignore_offset)

    @app.get("/api/v2/repos/{group}/{book}/toc")
    async def toc(group: str, book: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            repo = repo_of(group, book)
            if isinstance(repo, JSONResponse):
                return repo
            entries = [
                {"uuid": uuid, "type": "TITLE", "title": title, "parent_uuid": parent, "doc_id": None}
                for uuid, (title, parent) in repo.titles.items()
            ]
            entries += [
                {
                    "uuid": f"d{doc.id}",
                    "type": "DOC",
                    "title": doc.title,
                    "parent_uuid": doc.parent_uuid,
                    "id": doc.id,
                    "doc_id": doc.id,
                    "slug": doc.slug,
                    "url": doc.slug,
                }
                for doc in repo.docs.values()
            ]
        return JSONResponse({"data": entries})

    @app.get("/api/v2/search")
    async def search(request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            delay = fake.search_delay_s
        if delay:
            await asyncio.sleep(delay)
        query = request.query_params.get("q", "")
        page = request.query_params.get("page", "1")
        if not 1 <= len(query) <= 200 or not page.isdigit() or not 1 <= int(page) <= 100:
            return _error(400, "invalid parameters")
        scope = request.query_params.get("scope", "")
        terms = query.lower().split()
        with fake.lock:
            # ASSUMPTION: the ranking is undocumented; docs whose title or body has any term, newest first.
            hits = [
                {
                    "id": doc.id,
                    "type": "doc",
                    "title": doc.title,
                    "summary": f"...<em>{query}</em> {doc.body[:120]}",
                    "url": f"/{repo.namespace}/{doc.slug}",
                    "info": repo.name,
                    "target": {**doc.listed(repo.id), "book": repo.json()},
                }
                for repo in fake.repos.values()
                if not scope or repo.namespace == scope or repo.namespace.startswith(scope + "/")
                for doc in sorted(repo.docs.values(), key=lambda doc: -doc.updated)
                if any(term in f"{doc.title} {doc.body}".lower() for term in terms)
            ]
        start = (int(page) - 1) * SEARCH_PAGE
        meta = {"total": len(hits), "pageNo": int(page), "pageSize": SEARCH_PAGE}
        return JSONResponse({"meta": meta, "data": hits[start : start + SEARCH_PAGE]})

    async def written_fields(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body: Any = await request.json()
        except ValueError:
            return _error(400, "invalid parameters")
        if not isinstance(body, dict) or body.get("format", "markdown") not in ("markdown", "html", "lake"):
            return _error(422, "parameter validation failed")
        return body

    @app.post("/api/v2/repos/{group}/{book}/docs")
    async def create_doc(group: str, book: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        fields = await written_fields(request)
        if isinstance(fields, JSONResponse):
            return fields
        if not isinstance(fields.get("body"), str):
            return _error(422, "body is required")
        with fake.lock:
            repo = repo_of(group, book)
            if isinstance(repo, JSONResponse):
                return repo
            if repo.read_only:
                return _error(403, "no permission")
            doc = fake.add_doc(repo, str(fields.get("title") or "无标题"), fields["body"])
            doc.public = int(fields.get("public", repo.public))
            # API-made docs are not in the TOC until PUT …/toc: a parent would come from there.
            return JSONResponse({"data": {**doc.listed(repo.id), "format": "markdown", "body": doc.body}})

    @app.put("/api/v2/repos/{group}/{book}/docs/{doc_id}")
    async def update_doc(group: str, book: str, doc_id: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        fields = await written_fields(request)
        if isinstance(fields, JSONResponse):
            return fields
        with fake.lock:
            repo = repo_of(group, book)
            if isinstance(repo, JSONResponse):
                return repo
            doc = next((doc for doc in repo.docs.values() if doc_id in (str(doc.id), doc.slug)), None)
            if doc is None:
                return _error(404, "doc not found")
            if repo.read_only or doc.denied:
                return _error(403, "no permission")
            if isinstance(fields.get("title"), str):
                doc.title = fields["title"]
            if isinstance(fields.get("body"), str):
                fake.edit(doc, fields["body"])
            return JSONResponse({"data": {**doc.listed(repo.id), "format": "markdown", "body": doc.body}})

    @app.get("/api/v2/repos/{group}/{book}/docs/{doc_id}")
    async def get_doc(group: str, book: str, doc_id: str, request: Request) -> JSONResponse:
        if failed := gate(request):
            return failed
        with fake.lock:
            repo = repo_of(group, book)
            if isinstance(repo, JSONResponse):
                return repo
            doc = next((doc for doc in repo.docs.values() if doc_id in (str(doc.id), doc.slug)), None)
            if doc is None:
                return _error(404, "doc not found")
            if doc.denied:
                return _error(403, "no permission")
            data = {
                **doc.listed(repo.id),
                "format": doc.format,
                "body": doc.body,
                "body_html": doc.body_html,
                "body_lake": doc.body_lake,
            }
        return JSONResponse({"data": data})

    return app


@pytest.fixture(scope="session")
def fake_yuque_server() -> Iterator[FakeYuque]:
    """One server per test session: starting uvicorn per test would dominate the tests' time."""
    fake = FakeYuque()
    with serve_in_thread(create_app(fake), "fake-yuque") as base_url:
        fake.base_url = base_url
        yield fake


@pytest.fixture
def fake_yuque(fake_yuque_server: FakeYuque) -> Iterator[FakeYuque]:
    """The session's fake with its content, knobs and counters reset."""
    fake_yuque_server.reset()
    yield fake_yuque_server
    fake_yuque_server.reset()
