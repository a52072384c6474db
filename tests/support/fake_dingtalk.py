"""A local DingTalk OpenAPI (docs/platform-apis.md, DingTalk) over real HTTP, with faults tests can inject.

It serves the app token (``POST /v1.0/oauth2/accessToken``, and the legacy ``GET /gettoken`` that
answers the same token within its validity and extends it), the dentry search (metadata only, paged
with ``maxResults``/``nextToken``) and the blocks of ALIDOC documents. Every API call needs a valid
``x-acs-dingtalk-access-token`` and an ``operatorId``; a missing permission answers
``Forbidden.AccessDenied.AccessTokenPermissionDenied``, injected throttling ``LimitExceeded.Qps``.

Behaviour the sources do not document is chosen here and labelled ASSUMPTION, so a test never
mistakes it for a fact about the real service.

Use the ``fake_dingtalk`` fixture (register with ``pytest_plugins = ["tests.support.fake_dingtalk"]``).
"""

from __future__ import annotations

import asyncio
import itertools
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

__all__ = ["APP_KEY", "APP_SECRET", "OPERATOR", "FakeDentry", "FakeDingTalk", "create_app", "fake_dingtalk"]

APP_KEY = "ding-fake-app-key"
APP_SECRET = "fake-dingtalk-secret-0123456789"
OPERATOR = "union-ada-0001"
SEARCH_PERMISSION = "Storage.Dentry.Search"
READ_PERMISSION = "Storage.File.Read"


@dataclass
class FakeDentry:
    uuid: str
    name: str
    #: ``ALIDOC`` for online documents; others (``pdf``, ``docx``…) have no blocks.
    category: str = "ALIDOC"
    paragraphs: list[str] = field(default_factory=list)

    def listed(self) -> dict[str, Any]:
        person = {"name": "Ada", "userId": "u-ada"}
        return {"dentryUuid": self.uuid, "name": self.name, "creator": person, "modifier": person}


@dataclass
class FakeDingTalk:
    """State, knobs and counters of one fake server; ``base_url`` is set once it listens. Everything
    is read and written under ``lock``."""

    base_url: str = ""
    expire_in: int = 7200
    dentries: list[FakeDentry] = field(default_factory=list)
    permissions: set[str] = field(default_factory=lambda: {SEARCH_PERMISSION, READ_PERMISSION})
    #: The last page answers ``"nextToken": ""`` instead of leaving it out (which is real is undocumented).
    empty_next_token: bool = False
    #: Seconds every search waits before it answers.
    search_delay_s: float = 0.0
    #: HTTP statuses the next searches answer with, in order (500: an internal error).
    search_failures: deque[int] = field(default_factory=deque)
    throttles: int = 0
    tokens: dict[str, float] = field(default_factory=dict)
    token_requests: int = 0
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def add(self, name: str, *paragraphs: str, category: str = "ALIDOC") -> FakeDentry:
        with self.lock:
            dentry = FakeDentry(f"dentry-{next(self._ids):04d}", name, category, list(paragraphs))
            self.dentries.append(dentry)
            return dentry

    def revoke_tokens(self) -> None:
        """Every issued token stops working, as when it expired server-side."""
        with self.lock:
            self.tokens.clear()

    def reset(self) -> None:
        with self.lock:
            self.expire_in = 7200
            self.dentries.clear()
            self.permissions = {SEARCH_PERMISSION, READ_PERMISSION}
            self.empty_next_token = False
            self.search_delay_s = 0.0
            self.search_failures.clear()
            self.throttles = 0
            self.tokens.clear()
            self.token_requests = 0
            self.requests.clear()

    def searches(self) -> list[dict[str, str]]:
        """The query parameters of every search, in order."""
        with self.lock:
            return [query for path, _, query in self.requests if path == "/v2.0/storage/dentries/search"]

    def issue(self) -> str:
        with self.lock:
            self.token_requests += 1
            token = f"token-{next(self._ids)}"
            self.tokens[token] = time.monotonic() + self.expire_in
            return token


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"requestid": "fake-request", "code": code, "message": message}, status_code=status)


def create_app(fake: FakeDingTalk) -> FastAPI:
    """Build the ASGI app serving ``fake``'s behaviour."""
    app = FastAPI(title="fake DingTalk")

    def gate(request: Request, permission: str) -> JSONResponse | None:
        """Record the request; check the token, ``operatorId``, the permission and injected throttling."""
        with fake.lock:
            fake.requests.append((request.url.path, request.method, dict(request.query_params)))
            expires = fake.tokens.get(request.headers.get("x-acs-dingtalk-access-token", ""))
            if expires is None or expires < time.monotonic():
                # ASSUMPTION: the code of an invalid or expired token is undocumented.
                return _error(401, "InvalidAuthentication", "不合法的access_token")
            if not request.query_params.get("operatorId"):
                return _error(400, "MissingoperatorId", "operatorId is mandatory for this action.")
            if permission not in fake.permissions:
                return _error(
                    403,
                    "Forbidden.AccessDenied.AccessTokenPermissionDenied",
                    f"应用尚未开通所需的权限：[{permission}]",
                )
            if fake.throttles:
                fake.throttles -= 1
                # ASSUMPTION: the HTTP status of LimitExceeded.Qps is undocumented; 429.
                return _error(429, "LimitExceeded.Qps", "请求过于频繁")
        return None

    @app.post("/v1.0/oauth2/accessToken")
    async def access_token(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("appKey") != APP_KEY or body.get("appSecret") != APP_SECRET:
            # ASSUMPTION: the refusal's status and code are undocumented.
            return _error(400, "invalidClientIdOrSecret", "无效的clientId或者clientSecret")
        return JSONResponse({"accessToken": fake.issue(), "expireIn": fake.expire_in})

    @app.get("/gettoken")
    async def legacy_token(appkey: str = "", appsecret: str = "") -> JSONResponse:
        if appkey != APP_KEY or appsecret != APP_SECRET:
            return JSONResponse({"errcode": 40089, "errmsg": "不合法的corpid或corpsecret"})
        with fake.lock:
            fake.token_requests += 1
            valid = [token for token, expires in fake.tokens.items() if expires > time.monotonic()]
            token = valid[0] if valid else f"token-{next(fake._ids)}"
            fake.tokens[token] = time.monotonic() + fake.expire_in  # a repeated fetch extends it
        return JSONResponse({"errcode": 0, "errmsg": "ok", "access_token": token, "expires_in": fake.expire_in})

    @app.post("/v2.0/storage/dentries/search")
    async def search(request: Request) -> JSONResponse:
        if failed := gate(request, SEARCH_PERMISSION):
            return failed
        with fake.lock:
            delay = fake.search_delay_s
            failure = fake.search_failures.popleft() if fake.search_failures else None
        if delay:
            await asyncio.sleep(delay)
        if failure is not None:
            return _error(failure, "InternalError", "系统繁忙")
        body = await request.json()
        keyword = body.get("keyword")
        option = body.get("option") or {}
        if not isinstance(keyword, str) or not keyword:
            return _error(400, "InvalidParameter", "keyword is mandatory")
        size = option.get("maxResults", 20)
        if not isinstance(size, int) or not 1 <= size <= 50:
            # ASSUMPTION: the maxResults range is undocumented; 1..50.
            return _error(400, "InvalidParameter", "maxResults out of range")
        start = int(option.get("nextToken") or 0)
        terms = keyword.lower().split()
        with fake.lock:
            # ASSUMPTION: the search matches any term in the name or the text of the document.
            found = [
                dentry.listed()
                for dentry in fake.dentries
                if any(term in " ".join([dentry.name, *dentry.paragraphs]).lower() for term in terms)
            ]
            blank_last = fake.empty_next_token
        answer: dict[str, Any] = {"items": found[start : start + size]}
        if start + size < len(found):
            answer["nextToken"] = str(start + size)
        elif blank_last:
            answer["nextToken"] = ""
        return JSONResponse(answer)

    @app.get("/v1.0/doc/suites/documents/{dentry_uuid}/blocks")
    async def blocks(dentry_uuid: str, request: Request) -> JSONResponse:
        if failed := gate(request, READ_PERMISSION):
            return failed
        with fake.lock:
            dentry = next((dentry for dentry in fake.dentries if dentry.uuid == dentry_uuid), None)
        if dentry is None:
            return _error(404, "NotFound", "document not found")
        if dentry.category != "ALIDOC":
            # ASSUMPTION: the error for a file that is not an online document is undocumented.
            return _error(400, "InvalidParameter.DocType", "only online documents have blocks")
        end = int(request.query_params.get("endIndex", "1000"))
        data = [
            {"index": index, "id": f"b{index}", "blockType": "paragraph", "paragraph": {"text": text}}
            for index, text in enumerate(dentry.paragraphs[: end + 1])
        ]
        return JSONResponse({"success": True, "result": {"data": data}})

    return app


@pytest.fixture(scope="session")
def fake_dingtalk_server() -> Iterator[FakeDingTalk]:
    """One server per test session: starting uvicorn per test would dominate the tests' time."""
    fake = FakeDingTalk()
    with serve_in_thread(create_app(fake), "fake-dingtalk") as base_url:
        fake.base_url = base_url
        yield fake


@pytest.fixture
def fake_dingtalk(fake_dingtalk_server: FakeDingTalk) -> Iterator[FakeDingTalk]:
    """The session's fake with its content, knobs and counters reset."""
    fake_dingtalk_server.reset()
    yield fake_dingtalk_server
    fake_dingtalk_server.reset()
