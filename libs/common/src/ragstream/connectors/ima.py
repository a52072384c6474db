"""IMA (Tencent ima.copilot) connector: the notes of IMA knowledge bases, read as Markdown.

Vendor facts are in ``docs/platform-apis.md`` (IMA); there is no official Tencent page, so they come
from copies of the vendor's own skill package and from third-party clients. Where those are silent
the choice is marked ASSUMPTION here and in ``tests/support/fake_ima.py``.

- **Auth:** every call is a JSON ``POST`` with the headers ``ima-openapi-clientid`` and
  ``ima-openapi-apikey``. The envelope is ``{code, msg, data}``; ``{retcode, errmsg, data}`` (seen in
  one third-party note) is read the same way.
- **Listing:** the configured ``knowledge_base_ids``, else every base ``search_knowledge_base`` finds
  for the empty query; each base's ``get_knowledge_list`` is followed by ``cursor``/``next_cursor``
  until ``is_end``, and folders (ASSUMPTION: items whose ``media_id`` starts with ``folder_``, the
  prefix of a ``folder_id``) are walked the same way. Only notes (``media_type`` 11) are documents
  here; every other item is skipped and counted by its type (``skipped``).
- **Content:** ``get_media_info`` → ``notebook_ext_info.notebook_id`` → ``note/v1/get_doc_content``
  with ``target_content_format`` 1 (Markdown).
- **Limits and errors:** content export is capped at 50 a minute, so ``get_doc_content`` is paced to
  that; code 110021 (rate limited) waits ``throttled_wait_s`` and retries, HTTP 403 "请求超量" (over
  quota) waits a minute. 110030 (no permission) and 220030 (the key may not export) fail the one
  document. An item found unreadable is remembered for five minutes (``NegativeCache``): reading it
  again inside that time returns the same failure without calling the API, so a permission fix may
  take a few minutes to show.

The API key never reaches a message: server text is redacted and httpx errors are never chained.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.vendor_http import RateLimit, RetryPolicy, Transient, VendorError, VendorHttp, json_body

__all__ = [
    "IMA_BASE_URL",
    "MEDIA_TYPES",
    "NOTE",
    "ImaAuthError",
    "ImaClient",
    "ImaConfig",
    "ImaConnector",
    "ImaError",
    "ImaLimits",
    "NegativeCache",
]

logger = logging.getLogger(__name__)

IMA_BASE_URL = "https://ima.qq.com"
WIKI = "/openapi/wiki/v1"
NOTES = "/openapi/note/v1"

#: ``media_type`` of a note (笔记), the only kind indexed.
NOTE = 11
#: ``media_type`` names for the skipped counts (the skill package; 2 and 6 from other clients).
MEDIA_TYPES = {
    1: "pdf",
    2: "web_page",
    3: "word",
    4: "ppt",
    5: "excel",
    6: "wechat_article",
    7: "markdown_file",
    9: "image",
    11: "note",
    13: "txt",
    14: "xmind",
    15: "audio",
    19: "audio",
}
RATE_LIMITED = 110021
#: 110030 no permission; 220030 a key without export permission.
PERMISSION_CODES = frozenset({110030, 220030})
#: ASSUMPTION: the code of a media item that no longer exists is undocumented; 110004.
GONE_CODES = frozenset({110004})
OVER_QUOTA = "请求超量"
#: ASSUMPTION: ``limit`` of the cursor lists is undocumented beyond examples; 50.
PAGE_SIZE = 50
FOLDER_PREFIX = "folder_"


class ImaError(VendorError):
    """What the platform answered (HTTP ``status``, envelope ``code`` and ``msg``), without secrets."""

    @property
    def denied(self) -> bool:
        return self.code in PERMISSION_CODES

    @property
    def gone(self) -> bool:
        return self.status == 404 or self.code in GONE_CODES


class ImaAuthError(ImaError):
    """HTTP 401: the client id or API key is refused. It fails the sync rather than each document."""


@dataclass(frozen=True, slots=True)
class ImaLimits:
    """Client-side pacing: ``export`` (get_doc_content) is the documented 50 a minute; ASSUMPTION: the
    other calls have no published limit, 10 a second."""

    wiki: RateLimit = field(default_factory=lambda: RateLimit(10, 1.0))
    export: RateLimit = field(default_factory=lambda: RateLimit(50, 60.0))


class NegativeCache:
    """Items found unreadable, and the failure, for ``ttl_s`` seconds per key (by ``clock``)."""

    def __init__(self, ttl_s: float = 300.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[tuple[str, str], tuple[float, DocumentUnreadable]] = {}

    def get(self, key: tuple[str, str]) -> DocumentUnreadable | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() >= entry[0]:
            del self._entries[key]
            return None
        return entry[1]

    def put(self, key: tuple[str, str], failure: DocumentUnreadable) -> None:
        now = self._clock()
        # Expired entries go as new ones come, so the cache holds at most what failed in ttl_s.
        for stale in [key for key, (expires, _) in self._entries.items() if expires <= now]:
            del self._entries[stale]
        self._entries[key] = (now + self.ttl_s, failure)

    def forget(self, key: tuple[str, str]) -> None:
        self._entries.pop(key, None)


#: One per process, keyed by connection and media id: the connector of a connection is rebuilt for
#: each sync, and a failure it remembered must outlive that.
UNREADABLE = NegativeCache()


class ImaClient:
    """The OpenAPI calls the connector makes, with pacing and retries; the HTTP pool is opened on first
    use and closed by ``aclose``."""

    def __init__(
        self,
        client_id: SecretStr,
        api_key: SecretStr,
        *,
        base_url: str = IMA_BASE_URL,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        limits: ImaLimits | None = None,
        throttled_wait_s: float = 12.0,
        over_quota_wait_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not client_id.get_secret_value() or not api_key.get_secret_value():
            raise ValueError("an IMA client needs client_id and api_key")
        self._api_key = api_key
        limits = limits or ImaLimits()
        # ASSUMPTION: 110021 carries no wait; 12 s frees ten slots of a 50-a-minute window.
        self._throttled_wait_s = throttled_wait_s
        self._over_quota_wait_s = over_quota_wait_s
        self._http = VendorHttp(
            "ima",
            base_url,
            timeout_s=timeout_s,
            headers={
                "ima-openapi-clientid": client_id.get_secret_value(),
                "ima-openapi-apikey": api_key.get_secret_value(),
                "Content-Type": "application/json",
            },
            limits={"wiki": limits.wiki, "export": limits.export},
            retry=retry or RetryPolicy(max_wait_s=over_quota_wait_s),
            transport=transport,
            secrets=lambda: [self._api_key.get_secret_value()],
            error_type=ImaError,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def knowledge_bases(self) -> AsyncIterator[dict[str, Any]]:
        """Every knowledge base the key can see (the empty query matches all)."""
        return self._cursor(f"{WIKI}/search_knowledge_base", {"query": ""}, "info_list")

    async def knowledge_base(self, kb_id: str) -> dict[str, Any]:
        """One base by id. ASSUMPTION: the answer lists it in ``info_list`` as the search does."""
        data = await self._post(f"{WIKI}/get_knowledge_base", {"ids": [kb_id]}, "wiki")
        found = [info for info in data.get("info_list") or [] if isinstance(info, dict)]
        if not found:
            raise ImaError(f"knowledge base {kb_id}: not found", retryable=False)
        return found[0]

    def knowledge(self, kb_id: str, folder_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The items of a base's root, or of ``folder_id``."""
        body: dict[str, Any] = {"knowledge_base_id": kb_id}
        if folder_id:
            body["folder_id"] = folder_id
        return self._cursor(f"{WIKI}/get_knowledge_list", body, "knowledge_list")

    async def search_knowledge(self, query: str, kb_id: str) -> list[dict[str, Any]]:
        """The first page of a base's items matching ``query``, each with a ``highlight_content``
        snippet. ASSUMPTION: the list's key is undocumented; ``knowledge_list``, as in listings."""
        data = await self._post(
            f"{WIKI}/search_knowledge", {"query": query, "knowledge_base_id": kb_id, "cursor": ""}, "wiki"
        )
        return [item for item in data.get("knowledge_list") or [] if isinstance(item, dict)]

    async def knowledge_page(
        self, kb_id: str, *, folder_id: str | None = None, cursor: str = "", limit: int = PAGE_SIZE
    ) -> dict[str, Any]:
        """One cursor page of a base's root, or of ``folder_id``: ``knowledge_list``, ``next_cursor``,
        ``is_end`` and ``current_path`` (the folders from the root down to this one)."""
        body: dict[str, Any] = {"knowledge_base_id": kb_id, "cursor": cursor, "limit": limit}
        if folder_id:
            body["folder_id"] = folder_id
        return await self._post(f"{WIKI}/get_knowledge_list", body, "wiki")

    async def search_note(self, query: str, limit: int = PAGE_SIZE) -> list[dict[str, Any]]:
        """The first page of the key owner's notes (notebooks, outside any base) matching ``query``.
        ASSUMPTION: the fields of ``note/v1/search_note`` are undocumented; the body is ``{query,
        cursor, limit}`` like the wiki searches, and the answer's list is ``note_list`` (read as
        ``docs`` too), each item with a ``note_id`` (or ``doc_id``), ``title`` and a
        ``highlight_content`` (or ``summary``) snippet."""
        data = await self._post(f"{NOTES}/search_note", {"query": query, "cursor": "", "limit": limit}, "wiki")
        items = data.get("note_list") or data.get("docs") or []
        return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []

    async def media_info(self, media_id: str) -> dict[str, Any]:
        return await self._post(f"{WIKI}/get_media_info", {"media_id": media_id}, "wiki")

    async def note_markdown(self, note_id: str) -> str:
        data = await self._post(f"{NOTES}/get_doc_content", {"note_id": note_id, "target_content_format": 1}, "export")
        content = data.get("content")
        if not isinstance(content, str):
            raise ImaError(f"note {note_id}: the answer has no data.content", retryable=False)
        return content

    async def _cursor(self, path: str, body: Mapping[str, Any], key: str) -> AsyncIterator[dict[str, Any]]:
        """Every item, following ``next_cursor`` until ``is_end`` (or, without one, no next cursor)."""
        cursor = ""
        while True:
            data = await self._post(path, {**body, "cursor": cursor, "limit": PAGE_SIZE}, "wiki")
            for item in data.get(key) or []:
                if isinstance(item, dict):
                    yield item
            following = data.get("next_cursor")
            if data.get("is_end") is True or ("is_end" not in data and not following):
                return
            if not isinstance(following, str) or not following or following == cursor:
                # The same cursor again would loop forever; an incomplete listing must fail the sync.
                raise ImaError(f"{path}: is_end false without a new next_cursor", retryable=False)
            cursor = following

    async def _post(self, path: str, body: Mapping[str, Any], group: str) -> dict[str, Any]:
        """``data`` of a successful answer, after the retries; raises ``ImaError``."""
        return await self._http.retrying(lambda: self._call_once(path, body, group), path)

    async def _call_once(self, path: str, body: Mapping[str, Any], group: str) -> dict[str, Any]:
        await self._http.pace(group)
        response = await self._http.send("POST", path, json=dict(body))
        answer = json_body(response)
        code = answer.get("code", answer.get("retcode"))
        if response.is_success and code == 0:
            data = answer.get("data")
            return data if isinstance(data, dict) else {}
        raise self._failure(path, response, answer, code)

    def _failure(
        self, path: str, response: httpx.Response, answer: Mapping[str, Any], code: object
    ) -> ImaError | Transient:
        known = code if isinstance(code, int) else None
        message = str(answer.get("msg") or answer.get("errmsg") or response.reason_phrase or "no message")
        status = response.status_code
        text = self._http.redact(f"{path}: HTTP {status} code {known if known is not None else '-'}: {message}")
        if known == RATE_LIMITED or status == 429:
            return Transient(ImaError(text, status=status, code=known, retryable=True), self._throttled_wait_s)
        if status == 403 and OVER_QUOTA in message:
            return Transient(ImaError(text, status=status, code=known, retryable=True), self._over_quota_wait_s)
        if status >= 500 or status == 408:
            return Transient(ImaError(text, status=status, code=known, retryable=True))
        if status == 401:
            return ImaAuthError(text, status=status, code=known, retryable=False)
        return ImaError(text, status=status, code=known, retryable=False)


class ImaConfig(BaseModel):
    """The keys of an ``ima`` connection's config this connector reads (others, such as ``chunking``,
    belong to the pipeline)."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)

    base_url: str = Field(default=IMA_BASE_URL, description="ima.qq.com or a stand-in")
    knowledge_base_ids: list[str] | None = Field(default=None, description="Only these bases; unset: every base")
    search_notes: bool | None = Field(
        default=None,
        description="Direct search also searches the key owner's notebooks (search_note), beside the bases;"
        " unset: only when knowledge_base_ids is unset (a connection limited to some bases stays there)",
    )

    def searches_notes(self) -> bool:
        return self.search_notes if self.search_notes is not None else self.knowledge_base_ids is None


@dataclass(frozen=True, slots=True)
class _Base:
    kb_id: str
    name: str


class ImaConnector:
    """The notes of a connection's IMA knowledge bases.

    ``external_id`` is ``<kb_id>/<media_id>``; bases are walked in ascending ``kb_id + "/"`` order and
    each base's notes sorted, so ids ascend overall while one base's listing is held in memory.
    ``source_version``: ASSUMPTION: the list item's ``update_time`` (undocumented, but what the note
    APIs of the skill package return); without one every note is read again and its hash decides.
    ACL: None: the API shows no sharing, so the key owner's view is the connection's visibility.
    ``skipped`` counts, per type name, the items of the last listing that are not notes.
    """

    platform = "ima"
    media_type = "text/markdown"

    def __init__(
        self,
        connection_id: str,
        name: str,
        client: ImaClient,
        settings: ImaConfig | None = None,
        *,
        unreadable: NegativeCache | None = None,
    ) -> None:
        self.connection_id = connection_id
        self.name = name
        # Not named ``config``: that attribute would make the fetch stage store it (ConfiguredConnector).
        self.settings = settings or ImaConfig()
        self.skipped: Counter[str] = Counter()
        self._client = client
        self._unreadable = unreadable if unreadable is not None else UNREADABLE

    @classmethod
    def from_connection(
        cls,
        connection_id: str,
        name: str,
        config: Mapping[str, Any],
        credentials: Mapping[str, SecretStr],
        **client: Any,
    ) -> ImaConnector:
        """Build from a stored connection; ``ValueError`` (naming fields, never values of secrets) when
        the config or credentials cannot make one. ``client``: ImaClient options (tests)."""
        missing = [name for name in ("client_id", "api_key") if not credentials.get(name)]
        if missing:
            raise ValueError(f"ima connection {connection_id} needs credentials {', '.join(missing)}")
        try:
            settings = ImaConfig.model_validate(config)
        except ValidationError as error:
            fields = ", ".join(".".join(str(part) for part in item["loc"]) for item in error.errors())
            raise ValueError(f"ima connection {connection_id}: invalid config ({fields})") from None
        ima = ImaClient(credentials["client_id"], credentials["api_key"], base_url=settings.base_url, **client)
        return cls(connection_id, name, ima, settings)

    async def aclose(self) -> None:
        """Close the HTTP connections; the next call opens new ones."""
        await self._client.aclose()

    async def list_items(self) -> AsyncIterator[SourceItem]:
        self.skipped = Counter()
        for base in sorted(await self._bases(), key=lambda base: base.kb_id + "/"):
            items = [item async for item in self._base_items(base)]
            items.sort(key=lambda item: item.external_id)
            for item in items:
                yield item
        if self.skipped:
            counts = ", ".join(f"{kind} {count}" for kind, count in sorted(self.skipped.items()))
            logger.info("ima connection %s: items that are not notes skipped (%s)", self.connection_id, counts)

    async def _bases(self) -> list[_Base]:
        if self.settings.knowledge_base_ids is not None:
            bases = []
            for kb_id in self.settings.knowledge_base_ids:
                info = await self._client.knowledge_base(kb_id)
                bases.append(_Base(kb_id, _base_name(info) or kb_id))
            return bases
        found = []
        async for info in self._client.knowledge_bases():
            listed = info.get("kb_id") or info.get("id")  # Conflict in the sources: both names are seen
            if listed:
                found.append(_Base(str(listed), _base_name(info) or str(listed)))
        return found

    async def _base_items(self, base: _Base) -> AsyncIterator[SourceItem]:
        """Breadth first over the folders; ``seen`` guards against an item listed twice (a cycle)."""
        folders: deque[str | None] = deque([None])
        seen: set[str] = set()
        while folders:
            async for entry in self._client.knowledge(base.kb_id, folders.popleft()):
                media_id = str(entry.get("media_id") or "")
                if not media_id or media_id in seen:
                    continue
                seen.add(media_id)
                if media_id.startswith(FOLDER_PREFIX):
                    folders.append(media_id)
                elif entry.get("media_type") == NOTE:
                    yield self._item(base, entry)
                else:
                    kind = entry.get("media_type")
                    self.skipped[MEDIA_TYPES.get(kind, f"type_{kind}") if isinstance(kind, int) else "unknown"] += 1

    def _item(self, base: _Base, entry: Mapping[str, Any]) -> SourceItem:
        media_id = str(entry["media_id"])
        updated = entry.get("update_time")
        return SourceItem(
            external_id=f"{base.kb_id}/{media_id}",
            title=str(entry.get("title") or media_id),
            source=f"ima://{base.kb_id}/{media_id}",
            media_type=self.media_type,
            source_version=str(updated) if updated else None,
            knowledge_base=base.name,
            metadata={"kb_id": base.kb_id, "media_id": media_id},
        )

    async def fetch(self, item: SourceItem) -> bytes:
        key = (self.connection_id, str(item.metadata["media_id"]))
        if (remembered := self._unreadable.get(key)) is not None:
            raise remembered
        try:
            text = await self._note(key[1])
        except DocumentUnreadable as failure:
            self._unreadable.put(key, failure)
            raise
        self._unreadable.forget(key)
        return text.encode()

    async def _note(self, media_id: str) -> str:
        try:
            info = await self._client.media_info(media_id)
            ext = info.get("notebook_ext_info")
            note_id = ext.get("notebook_id") if isinstance(ext, dict) else None
            if not note_id:
                raise DocumentUnreadable(
                    "no_content", f"IMA gives no notebook_id for note {media_id}: it cannot be read", retryable=False
                )
            return await self._client.note_markdown(str(note_id))
        except ImaAuthError:
            raise  # the key is refused: nothing else can be read either, so the sync fails
        except ImaError as error:
            if error.gone:
                raise DocumentVanished(media_id) from None
            if error.denied:
                raise DocumentUnreadable(
                    "permission_denied",
                    f"the IMA key may not read this note ({error}); it needs the note and the export permission",
                    retryable=False,
                ) from None
            code = "platform_unavailable" if error.retryable else "platform_error"
            raise DocumentUnreadable(code, str(error), retryable=error.retryable) from None


def _base_name(info: Mapping[str, Any]) -> str:
    return str(info.get("kb_name") or info.get("name") or "")
