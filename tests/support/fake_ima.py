"""A local IMA OpenAPI (docs/platform-apis.md, IMA) over real HTTP, with faults tests can inject.

It serves what the connector calls, all JSON ``POST``: ``wiki/v1/search_knowledge_base``,
``get_knowledge_base``, ``get_knowledge_list`` (cursor lists ending in ``is_end``, folders with
``current_path``), ``search_knowledge`` (``highlight_content`` snippets), ``get_media_info``
(``notebook_ext_info`` for notes, ``url_info`` for files, whose download it also serves) and
``note/v1/get_doc_content``, and ``note/v1/search_note`` over the key owner's notebook notes (in
no base). Both headers are checked; the envelope is ``{code, msg, data}`` or, when
switched, ``{retcode, errmsg, data}``. Export (get_doc_content) is
capped at 50 a minute, answered with code 110021, which can also be injected; 110030 answers a media
item the key may not read and 220030 an export by a key without the export permission.

Behaviour the sources do not document is chosen here and labelled ASSUMPTION.

Use the ``fake_ima`` fixture (register with ``pytest_plugins = ["tests.support.fake_ima"]``).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.support.http_server import serve_in_thread

__all__ = ["DEFAULT_API_KEY", "DEFAULT_CLIENT_ID", "FakeBase", "FakeIma", "FakeMedia", "create_app", "fake_ima"]

DEFAULT_CLIENT_ID = "fake-ima-client-0123"
DEFAULT_API_KEY = "fake-ima-apikey-0123456789abcdef"
NOTE = 11
#: ASSUMPTION: the page size of the cursor lists is undocumented; at most 50 items a page.
MAX_LIMIT = 50
#: Export is capped at 50 a minute.
EXPORT_LIMIT = (50, 60.0)


@dataclass
class FakeMedia:
    media_id: str
    title: str
    media_type: int
    content: str = ""
    folder_id: str = ""
    update_time: int = 0
    #: get_media_info answers 110030.
    denied: bool = False
    #: get_media_info answers without notebook_ext_info / url_info (an unreadable item).
    empty: bool = False

    @property
    def note_id(self) -> str:
        return f"note-{self.media_id}"


@dataclass
class FakeBase:
    kb_id: str
    name: str
    media: dict[str, FakeMedia] = field(default_factory=dict)
    #: folder id → (name, parent folder id).
    folders: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass
class FakeIma:
    """State, knobs and counters of one fake server; everything is read and written under ``lock``."""

    client_id: str = DEFAULT_CLIENT_ID
    api_key: str = DEFAULT_API_KEY
    base_url: str = ""
    #: Answer with ``{retcode, errmsg, data}`` instead of ``{code, msg, data}``.
    retcode_envelope: bool = False
    #: The key may not export (every get_doc_content answers 220030).
    export_denied: bool = False
    export_limit: tuple[int, float] = EXPORT_LIMIT
    bases: dict[str, FakeBase] = field(default_factory=dict)
    #: Notes of the key owner's notebooks, in no knowledge base (found by search_note).
    notebook: dict[str, FakeMedia] = field(default_factory=dict)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    throttles: deque[str] = field(default_factory=deque)
    #: Requests still to answer HTTP 403 "请求超量" (over quota).
    over_quota: int = 0
    rate_limited: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _exports: deque[float] = field(default_factory=deque)
    _cursors: dict[str, tuple[str, int]] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def add_base(self, name: str) -> FakeBase:
        with self.lock:
            base = FakeBase(f"kb_{next(self._ids)}", name)
            self.bases[base.kb_id] = base
            return base

    def add_folder(self, base: FakeBase, name: str, parent: str = "") -> str:
        with self.lock:
            folder_id = f"folder_{next(self._ids)}"
            base.folders[folder_id] = (name, parent)
            return folder_id

    def add(
        self, base: FakeBase, title: str, content: str = "", *, media_type: int = NOTE, folder: str = ""
    ) -> FakeMedia:
        with self.lock:
            number = next(self._ids)
            media = FakeMedia(f"m{number:04d}{secrets.token_hex(3)}", title, media_type, content, folder, number)
            base.media[media.media_id] = media
            return media

    def add_note(self, title: str, content: str) -> FakeMedia:
        """A notebook note, outside every base."""
        with self.lock:
            number = next(self._ids)
            media = FakeMedia(f"n{number:04d}{secrets.token_hex(3)}", title, NOTE, content, "", number)
            self.notebook[media.media_id] = media
            return media

    def edit(self, media: FakeMedia, content: str) -> None:
        with self.lock:
            media.content = content
            media.update_time += 1000

    def delete(self, base: FakeBase, media: FakeMedia) -> None:
        with self.lock:
            del base.media[media.media_id]

    def throttle_next(self, n: int = 1, *, path: str = "/openapi/") -> None:
        """The next ``n`` requests under ``path`` answer code 110021."""
        with self.lock:
            self.throttles.extend([path] * n)

    def over_quota_next(self, n: int = 1) -> None:
        """The next ``n`` requests answer HTTP 403 with msg "请求超量" (over quota)."""
        with self.lock:
            self.over_quota += n

    def forget_exports(self) -> None:
        """Empty the export window, as a minute without exports would."""
        with self.lock:
            self._exports.clear()

    def reset(self) -> None:
        with self.lock:
            self.retcode_envelope = self.export_denied = False
            self.export_limit = EXPORT_LIMIT
            self.bases.clear()
            self.notebook.clear()
            self.requests.clear()
            self.throttles.clear()
            self.over_quota = 0
            self._exports.clear()
            self._cursors.clear()
            self.rate_limited = 0

    def calls(self, name: str) -> list[dict[str, Any]]:
        """The bodies of the requests to the endpoint ``name`` (e.g. ``get_doc_content``), in order."""
        with self.lock:
            return [body for path, body in self.requests if path.rsplit("/", 1)[-1] == name]

    def find(self, media_id: str) -> FakeMedia | None:
        with self.lock:
            return next((base.media[media_id] for base in self.bases.values() if media_id in base.media), None)

    def export_over_limit(self) -> bool:
        requests, per_s = self.export_limit
        now = time.monotonic()
        with self.lock:
            while self._exports and now - self._exports[0] >= per_s:
                self._exports.popleft()
            if len(self._exports) >= requests:
                return True
            self._exports.append(now)
            return False

    def page(self, key: str, items: list[dict[str, Any]], body: dict[str, Any]) -> dict[str, Any] | None:
        """One cursor page of ``items``, or None for a cursor this list did not hand out."""
        limit = body.get("limit")
        size = min(limit, MAX_LIMIT) if isinstance(limit, int) and limit > 0 else MAX_LIMIT
        with self.lock:
            start = 0
            if cursor := body.get("cursor"):
                if cursor not in self._cursors or self._cursors[cursor][0] != key:
                    return None
                start = self._cursors.pop(cursor)[1]
            stop = start + size
            page: dict[str, Any] = {"is_end": stop >= len(items), "next_cursor": ""}
            if not page["is_end"]:
                page["next_cursor"] = following = secrets.token_urlsafe(9)
                self._cursors[following] = (key, stop)
            return {"items": items[start:stop], **page}


def create_app(fake: FakeIma) -> FastAPI:
    """Build the ASGI app serving ``fake``'s behaviour."""
    app = FastAPI(title="fake IMA")

    def envelope(code: int, msg: str, data: dict[str, Any] | None = None, status: int = 200) -> JSONResponse:
        names = ("retcode", "errmsg") if fake.retcode_envelope else ("code", "msg")
        return JSONResponse({names[0]: code, names[1]: msg, "data": data or {}}, status_code=status)

    async def gate(request: Request) -> tuple[dict[str, Any], JSONResponse | None]:
        try:
            body: Any = await request.json()
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        path = request.url.path
        with fake.lock:
            fake.requests.append((path, body))
        headers = request.headers
        if headers.get("ima-openapi-clientid") != fake.client_id or headers.get("ima-openapi-apikey") != fake.api_key:
            # ASSUMPTION: the answer to wrong credentials is undocumented; HTTP 401 with a non-zero code.
            return body, envelope(401, "invalid client id or api key", status=401)
        with fake.lock:
            throttled = next((prefix for prefix in fake.throttles if path.startswith(prefix)), None)
            if throttled is not None:
                fake.throttles.remove(throttled)
                fake.rate_limited += 1
            over_quota = throttled is None and fake.over_quota > 0
            if over_quota:
                fake.over_quota -= 1
        if throttled is not None:
            return body, envelope(110021, "rate limited")
        if over_quota:
            # ASSUMPTION: the envelope code of an over-quota 403 is undocumented; -1.
            return body, envelope(-1, "请求超量", status=403)
        return body, None

    def listing(key: str, items: list[dict[str, Any]], body: dict[str, Any], name: str, **extra: Any) -> JSONResponse:
        page = fake.page(key, items, body)
        if page is None:
            # ASSUMPTION: an unknown cursor is undocumented; code 100001 "invalid parameter".
            return envelope(100001, "invalid cursor")
        data = {name: page["items"], "next_cursor": page["next_cursor"], "is_end": page["is_end"], **extra}
        return envelope(0, "ok", data)

    def base_json(base: FakeBase) -> dict[str, Any]:
        return {"kb_id": base.kb_id, "kb_name": base.name, "content_count": len(base.media)}

    @app.post("/openapi/wiki/v1/search_knowledge_base")
    async def search_knowledge_base(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        with fake.lock:
            query = str(body.get("query") or "")
            items = [base_json(base) for base in fake.bases.values() if query in base.name]
        return listing(f"bases:{query}", items, body, "info_list")

    @app.post("/openapi/wiki/v1/get_knowledge_base")
    async def get_knowledge_base(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        ids = body.get("ids")
        if not isinstance(ids, list) or not 1 <= len(ids) <= 20:
            return envelope(100001, "ids: 1 to 20")
        with fake.lock:
            return envelope(0, "ok", {"info_list": [base_json(fake.bases[kb]) for kb in ids if kb in fake.bases]})

    @app.post("/openapi/wiki/v1/get_knowledge_list")
    async def get_knowledge_list(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        with fake.lock:
            base = fake.bases.get(str(body.get("knowledge_base_id")))
            if base is None:
                return envelope(110030, "no permission")
            folder = str(body.get("folder_id") or "")
            items: list[dict[str, Any]] = [
                # ASSUMPTION: a folder is listed as an item whose media_id is its folder_id, type 0.
                {"media_id": folder_id, "title": name, "media_type": 0, "parent_folder_id": folder}
                for folder_id, (name, parent) in base.folders.items()
                if parent == folder
            ]
            items += [
                {
                    "media_id": media.media_id,
                    "title": media.title,
                    "media_type": media.media_type,
                    "parent_folder_id": folder,
                    "update_time": media.update_time,
                }
                for media in base.media.values()
                if media.folder_id == folder
            ]
            path = []
            while folder:
                path.insert(0, {"folder_id": folder, "name": base.folders[folder][0]})
                folder = base.folders[folder][1]
        key = f"list:{base.kb_id}:{body.get('folder_id') or ''}"
        return listing(key, items, body, "knowledge_list", current_path=path)

    @app.post("/openapi/wiki/v1/search_knowledge")
    async def search_knowledge(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        query = str(body.get("query") or "")
        with fake.lock:
            base = fake.bases.get(str(body.get("knowledge_base_id")))
            if base is None:
                return envelope(110030, "no permission")
            # ASSUMPTION: the answer's list key and ranking are undocumented; ``knowledge_list`` (as
            # get_knowledge_list's), items whose title or content has any term, in the base's order.
            items = [
                {
                    "media_id": media.media_id,
                    "title": media.title,
                    "parent_folder_id": media.folder_id,
                    "highlight_content": f"<em>{query}</em> {media.content[:120]}",
                }
                for media in base.media.values()
                if any(term in f"{media.title} {media.content}".lower() for term in query.lower().split())
            ]
        return listing(f"search:{base.kb_id}:{query}", items, body, "knowledge_list")

    @app.post("/openapi/note/v1/search_note")
    async def search_note(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        query = str(body.get("query") or "")
        with fake.lock:
            # ASSUMPTION: search_note's fields are undocumented; ``note_list`` items with ``note_id``,
            # ``title`` and ``highlight_content``, notes whose title or content has any term.
            items = [
                {
                    "note_id": media.note_id,
                    "title": media.title,
                    "highlight_content": f"<em>{query}</em> {media.content[:120]}",
                }
                for media in fake.notebook.values()
                if any(term in f"{media.title} {media.content}".lower() for term in query.lower().split())
            ]
        return listing(f"notes:{query}", items, body, "note_list")

    @app.post("/openapi/wiki/v1/get_media_info")
    async def get_media_info(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        media = fake.find(str(body.get("media_id")))
        if media is None:
            return envelope(110004, "media not found")  # ASSUMPTION: the code of a deleted item
        if media.denied:
            return envelope(110030, "no permission")
        data: dict[str, Any] = {"media_type": media.media_type}
        if not media.empty:
            if media.media_type == NOTE:
                data["notebook_ext_info"] = {"notebook_id": media.note_id}
            else:
                url = f"{fake.base_url}/files/{media.media_id}"
                data["url_info"] = {"url": url, "headers": {"x-download-token": media.note_id}}
        return envelope(0, "ok", data)

    @app.post("/openapi/note/v1/get_doc_content")
    async def get_doc_content(request: Request) -> JSONResponse:
        body, failed = await gate(request)
        if failed:
            return failed
        if fake.export_denied:
            return envelope(220030, "api key has no export permission")
        if fake.export_over_limit():
            with fake.lock:
                fake.rate_limited += 1
            return envelope(110021, "rate limited")
        note_id = str(body.get("note_id") or body.get("doc_id") or "")  # Conflict: both names are seen
        with fake.lock:
            every = [*(m for base in fake.bases.values() for m in base.media.values()), *fake.notebook.values()]
            media = next((m for m in every if m.note_id == note_id), None)
        if media is None:
            return envelope(110004, "note not found")
        return envelope(0, "ok", {"content": media.content})

    @app.get("/files/{media_id}")
    async def download(media_id: str, request: Request) -> Response:
        """A file's bytes, for the headers ``url_info`` gave (ASSUMPTION: their names are undocumented)."""
        media = fake.find(media_id)
        if media is None or request.headers.get("x-download-token") != media.note_id:
            return Response(status_code=403)
        return Response(media.content.encode(), media_type="application/octet-stream")

    return app


@pytest.fixture(scope="session")
def fake_ima_server() -> Iterator[FakeIma]:
    """One server per test session: starting uvicorn per test would dominate the tests' time."""
    fake = FakeIma()
    with serve_in_thread(create_app(fake), "fake-ima") as base_url:
        fake.base_url = base_url
        yield fake


@pytest.fixture
def fake_ima(fake_ima_server: FakeIma) -> Iterator[FakeIma]:
    """The session's fake with its content, knobs and counters reset."""
    fake_ima_server.reset()
    yield fake_ima_server
    fake_ima_server.reset()
