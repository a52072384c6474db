"""The knowledge tool's dispatch: each action checked against its platform's operations, run, and
answered as a result or a structured error (never an exception).

- **search** is ``POST /v1/search`` (local index and live platforms), narrowed to ``platform`` /
  ``connection_id`` when named. Per conversation, the second search in a row without a result, and
  every one after it, carries ``hint``: the index may be stale, and how to sync.
- **read** opens a document a search answered: an indexed one from the index (whole, up to
  ``WHOLE_DOCUMENT_CHARS``), a live one (``direct:<connection>:<id>``) from its platform; either
  under the citation number the conversation already gave it, and only if the caller may see it.
- **list_documents** browses an IMA knowledge base by folder; elsewhere ``unsupported_operation``.
- **create** / **update** write a full Markdown body where the platform allows it (Yuque): an update
  to under a quarter of a document's length is refused as a likely summary unless ``shorten``; they need
  the principal of the user the expert writes for, who must be able to see the place written to. The
  written document reaches search at once: a RAG connection starts a sync (``on_written``), a live
  one is searched on the platform itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from ragstream.admission import Overloaded
from ragstream.core.search import Principal, SearchFilters, SearchRequest, SearchResponse
from ragstream.knowledge.models import (
    Action,
    CreateAction,
    DocumentEntry,
    DocumentList,
    DocumentWritten,
    ErrorCode,
    IndexingState,
    KnowledgeError,
    KnowledgeResponse,
    ListDocumentsAction,
    ReadAction,
    SearchAction,
    UpdateAction,
)
from ragstream.knowledge.platforms import (
    OPERATIONS,
    KnowledgeFailure,
    PlatformOperations,
    WrittenDocument,
    refusal,
    supports,
)
from ragstream.knowledge.registry import operations_for
from ragstream.logs import log_context
from ragstream.retrieval.budget import truncate_text
from ragstream.retrieval.direct import DIRECT_RETRY
from ragstream.retrieval.reader import DocumentRead, DocumentReader
from ragstream.retrieval.with_direct import live_document_id
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import DatabaseBusy, DatabaseUnavailable
from ragstream.storage.documents import document_id as indexed_document_id
from ragstream.storage.knowledge import KnowledgeConnection, KnowledgeStore
from ragstream.vendor_http import RetryPolicy, VendorError

__all__ = [
    "EMPTY_SEARCHES_FOR_HINT",
    "SHORTENING_FLOOR_CHARS",
    "WHOLE_DOCUMENT_CHARS",
    "KnowledgeService",
    "Searcher",
    "stale_index_hint",
]

logger = logging.getLogger(__name__)

#: A read gives the whole document (search results are cut to the context budget; a read is how the
#: expert gets the rest), up to this many characters.
WHOLE_DOCUMENT_CHARS = 200_000
#: Searches in a row without a result, in one conversation, before the answer carries the hint.
EMPTY_SEARCHES_FOR_HINT = 2
#: Documents shorter than this may be replaced by anything: a quarter of them is no sign of a summary.
SHORTENING_FLOOR_CHARS = 400
_LIVE_PREFIX = "direct:"

T = TypeVar("T")

KnowledgeAction = SearchAction | ReadAction | ListDocumentsAction | CreateAction | UpdateAction


class Searcher(Protocol):
    async def search(self, request: SearchRequest) -> SearchResponse: ...


def stale_index_hint(empty_searches: int) -> str:
    return (
        f"{empty_searches} searches in a row found nothing. The index may be stale: a document added or "
        "changed on the platform since the last sync is not searchable until the connection syncs again. "
        "Ask the user to sync it (Settings → Knowledge → Sync; API: POST /v1/connections/{connection_id}/sync) "
        "rather than saying the document does not exist."
    )


class KnowledgeService:
    """``searcher`` is a getter (None while the store opens); ``on_written`` starts a sync of a RAG
    connection after a write and says how that went; without it (the retriever service), create and
    update answer ``not_served_here``."""

    def __init__(
        self,
        searcher: Callable[[], Searcher | None],
        reader: DocumentReader,
        store: KnowledgeStore,
        citations: CitationStore,
        *,
        on_written: Callable[[str], Awaitable[IndexingState]] | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy = DIRECT_RETRY,
    ) -> None:
        self._searcher = searcher
        self._reader = reader
        self._store = store
        self._citations = citations
        self._on_written = on_written
        self._timeout_s = timeout_s
        self._retry = retry

    async def handle(self, request: KnowledgeAction) -> KnowledgeResponse:
        """Answer one action, logged with the connection id it names (if any)."""
        with log_context(connection_id=request.connection_id):
            return await self._answer(request)

    async def _answer(self, request: KnowledgeAction) -> KnowledgeResponse:
        answer = KnowledgeResponse(action=request.action)
        if request.platform is not None and request.platform not in OPERATIONS:
            known = ", ".join(sorted(OPERATIONS))
            return _failed(answer, ErrorCode.INVALID_REQUEST, f"unknown platform {request.platform!r}: one of {known}")
        try:
            match request:
                case SearchAction():
                    search, hint = await self._search(request)
                    return answer.model_copy(update={"search": search, "hint": hint})
                case ReadAction():
                    return answer.model_copy(update={"read": await self._read(request)})
                case ListDocumentsAction():
                    return answer.model_copy(update={"documents": await self._list(request)})
                case CreateAction() | UpdateAction():
                    return answer.model_copy(update={"written": await self._write(request)})
        except KnowledgeFailure as failure:
            return _failed(answer, failure.code, failure.message)
        except VendorError as error:
            return _failed(answer, *_vendor_failure(error))
        except TimeoutError:
            return _failed(
                answer, ErrorCode.PLATFORM_UNAVAILABLE, f"the platform gave no answer in {self._timeout_s:g}s"
            )
        except (Overloaded, DatabaseBusy, DatabaseUnavailable):
            return _failed(answer, ErrorCode.UNAVAILABLE, "the service is busy: try again in a moment")
        except Exception:  # the tool never throws into the conversation: the log has the traceback
            logger.exception("knowledge %s failed", request.action)
            return _failed(answer, ErrorCode.INTERNAL, f"{request.action} failed; the server log says why")
        raise AssertionError(f"unhandled action {request.action}")  # pragma: no cover - the union is closed

    # --- search --------------------------------------------------------------------------------------

    async def _search(self, request: SearchAction) -> tuple[SearchResponse, str | None]:
        searcher = self._searcher()
        if searcher is None:
            raise KnowledgeFailure(ErrorCode.UNAVAILABLE, "the index is still starting")
        filters = request.filters
        if request.platform is not None:
            filters = filters.model_copy(update={"platforms": _narrowed(filters.platforms, request.platform)})
        if request.connection_id is not None:
            filters = filters.model_copy(
                update={"connection_ids": _narrowed(filters.connection_ids, request.connection_id)}
            )
        response = await searcher.search(
            SearchRequest(
                query=request.query,
                top_k=request.top_k,
                filters=SearchFilters.model_validate(filters.model_dump()),
                principal=request.principal,
                conversation_id=request.conversation_id,
                history=request.history,
            )
        )
        if request.conversation_id is None:
            return response, None
        empty = await self._store.record_search(request.conversation_id, found=bool(response.results))
        return response, stale_index_hint(empty) if empty >= EMPTY_SEARCHES_FOR_HINT else None

    # --- read ----------------------------------------------------------------------------------------

    async def _read(self, request: ReadAction) -> DocumentRead:
        if request.document_id.startswith(_LIVE_PREFIX):
            return await self._read_live(request)
        document = await self._reader.read(
            request.document_id,
            request.principal,
            conversation_id=request.conversation_id,
            max_chars=WHOLE_DOCUMENT_CHARS,
        )
        if document is None or not _matches(request, document.connection_id, document.platform):
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no document {request.document_id} that this caller may read")
        return document

    async def _read_live(self, request: ReadAction) -> DocumentRead:
        connection_id, external_id = _live_parts(request.document_id)
        connection = await self._connection_by_id(connection_id)
        if not _matches(request, connection.id, connection.platform):
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no document {request.document_id} that this caller may read")
        document = await self._on_platform(connection, lambda operations: operations.read(external_id))
        if not _may_see(connection, document.acl, request.principal):
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no document {request.document_id} that this caller may read")
        number = 1
        if request.conversation_id:
            assigned = await self._citations.assign(request.conversation_id, [request.document_id])
            number = assigned[request.document_id]
        text = document.text
        truncated = len(text) > WHOLE_DOCUMENT_CHARS
        return DocumentRead(
            document_id=request.document_id,
            citation_index=number,
            connection_id=connection.id,
            platform=connection.platform,
            knowledge_base=document.knowledge_base,
            title=document.title,
            source=document.url or external_id,
            url=document.url,
            text=truncate_text(text, WHOLE_DOCUMENT_CHARS) if truncated else text,
            truncated=truncated,
        )

    # --- list_documents ------------------------------------------------------------------------------

    async def _list(self, request: ListDocumentsAction) -> DocumentList:
        connection = await self._resolve(request.platform, request.connection_id, "list_documents")
        listing = await self._on_platform(
            connection,
            lambda operations: operations.list_documents(
                request.knowledge_base_id, request.folder_id, request.cursor, request.limit
            ),
        )
        return DocumentList(
            connection_id=connection.id,
            platform=connection.platform,
            knowledge_base_id=listing.knowledge_base_id,
            folder_id=listing.folder_id,
            path=listing.path,
            entries=[
                DocumentEntry(
                    kind=entry.kind,  # type: ignore[arg-type]  # the adapters list only the three kinds
                    id=entry.id,
                    title=entry.title,
                    document_id=_document_id(connection, entry.external_id) if entry.external_id else None,
                    media_type=entry.media_type,
                )
                for entry in listing.entries
            ],
            next_cursor=listing.next_cursor,
        )

    # --- create and update ---------------------------------------------------------------------------

    async def _write(self, request: CreateAction | UpdateAction) -> DocumentWritten:
        if request.platform is not None and not supports(request.platform, request.action):
            raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(request.platform, request.action))
        if self._on_written is None:
            raise KnowledgeFailure(
                ErrorCode.NOT_SERVED_HERE,
                f"{request.action} is served by the control plane (ragstream up, the fetcher)",
            )
        if request.principal is None:
            raise KnowledgeFailure(
                ErrorCode.INVALID_REQUEST, f"{request.action} needs the principal of the user the expert writes for"
            )
        principal = request.principal
        if isinstance(request, UpdateAction):
            connection, external_id = await self._origin(request)

            update = request

            async def replace(operations: PlatformOperations) -> WrittenDocument:
                current = await operations.read(external_id)  # it exists, and the caller may see it
                if not _may_see(connection, current.acl, principal):
                    raise KnowledgeFailure(
                        ErrorCode.NOT_FOUND, f"no document {update.document_id} this caller may read"
                    )
                if _looks_summarised(update.body, current.text) and not update.shorten:
                    raise KnowledgeFailure(
                        ErrorCode.INVALID_REQUEST,
                        f"the new body has {len(update.body)} characters, under a quarter of the current "
                        f"{len(current.text)}: pass the full document body, not a summary (or shorten: true)",
                    )
                return await operations.update(external_id, update.title, update.body)

            written = await self._on_platform(connection, replace)
        else:
            connection = await self._resolve(request.platform, request.connection_id, "create")
            creation = request

            async def create(operations: PlatformOperations) -> WrittenDocument:
                place, acl = await operations.target(creation.knowledge_base)
                if not _may_see(connection, acl, principal):
                    raise KnowledgeFailure(ErrorCode.FORBIDDEN, f"this caller may not write to {place}")
                return await operations.create(place, creation.title, creation.body)

            written = await self._on_platform(connection, create)
        indexing: IndexingState = await self._on_written(connection.id) if connection.rag_enabled else "live"
        return DocumentWritten(
            connection_id=connection.id,
            platform=connection.platform,
            document_id=_document_id(connection, written.external_id),
            knowledge_base=written.knowledge_base,
            title=written.title,
            url=written.url,
            indexing=indexing,
        )

    async def _origin(self, request: UpdateAction) -> tuple[KnowledgeConnection, str]:
        """The connection and platform id of the document to update, checked against the platform's
        operations (before anything is read) and the request's platform and connection."""
        if request.document_id.startswith(_LIVE_PREFIX):
            connection_id, external_id = _live_parts(request.document_id)
        else:
            origin = await self._store.indexed(request.document_id)
            if origin is None:
                raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no document {request.document_id}")
            connection_id, external_id = origin.connection_id, origin.external_id
        connection = await self._connection_by_id(connection_id)
        if not supports(connection.platform, "update"):
            raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(connection.platform, "update"))
        if not _matches(request, connection.id, connection.platform):
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no document {request.document_id} on the named connection")
        return connection, external_id

    # --- connections and platforms -------------------------------------------------------------------

    async def _resolve(self, platform: str | None, connection_id: str | None, action: Action) -> KnowledgeConnection:
        """The one connection an action names: ``connection_id``, or the only active one of ``platform``.
        The platform's support is checked first, so a refusal does not depend on what is connected."""
        if platform is not None and not supports(platform, action):
            raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(platform, action))
        if platform is None and connection_id is None:
            raise KnowledgeFailure(ErrorCode.INVALID_REQUEST, f"{action} needs a platform or a connection_id")
        found = await self._store.connections(platform=platform, connection_id=connection_id)
        if not found:
            where = f"connection {connection_id}" if connection_id else f"connection of platform {platform}"
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no active {where}")
        if len(found) > 1:
            ids = ", ".join(connection.id for connection in found)
            raise KnowledgeFailure(
                ErrorCode.AMBIGUOUS_CONNECTION, f"several {platform} connections ({ids}): name one as connection_id"
            )
        connection = found[0]
        if not supports(connection.platform, action):
            raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(connection.platform, action))
        return connection

    async def _connection_by_id(self, connection_id: str) -> KnowledgeConnection:
        found = await self._store.connections(connection_id=connection_id)
        if not found:
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no active connection {connection_id}")
        return found[0]

    async def _on_platform(
        self, connection: KnowledgeConnection, call: Callable[[PlatformOperations], Awaitable[T]]
    ) -> T:
        """``call`` with the connection's operations, within the platform timeout; the HTTP pool is
        closed afterwards (the tool's calls are rare next to searches)."""
        if connection.unreadable is not None:
            raise KnowledgeFailure(ErrorCode.PLATFORM_ERROR, f"connection {connection.id}: {connection.unreadable}")
        try:
            operations = operations_for(connection, timeout_s=self._timeout_s, retry=self._retry)
        except ValueError as error:
            raise KnowledgeFailure(ErrorCode.PLATFORM_ERROR, str(error)) from None
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call(operations)
        finally:
            await operations.aclose()


def _looks_summarised(body: str, current: str) -> bool:
    """Whether ``body`` would replace a document of some length with under a quarter of it."""
    return len(current) >= SHORTENING_FLOOR_CHARS and len(body) * 4 < len(current)


def _failed(answer: KnowledgeResponse, code: ErrorCode, message: str) -> KnowledgeResponse:
    return answer.model_copy(update={"error": KnowledgeError(code=code, message=message)})


def _vendor_failure(error: VendorError) -> tuple[ErrorCode, str]:
    if error.status == 401:
        return ErrorCode.PLATFORM_ERROR, f"the platform refused the connection's credentials ({error})"
    if error.status == 403 or getattr(error, "denied", False):
        return ErrorCode.FORBIDDEN, f"the platform refused this to the connection's credentials ({error})"
    if error.status == 404 or getattr(error, "gone", False):
        return ErrorCode.NOT_FOUND, f"the platform has no such document ({error})"
    if error.retryable:
        return ErrorCode.PLATFORM_UNAVAILABLE, str(error)
    return ErrorCode.PLATFORM_ERROR, str(error)


def _narrowed(values: list[str] | None, named: str) -> list[str]:
    """The filter's list narrowed to the named value (empty when the filter excludes it)."""
    return [named] if values is None or named in values else []


def _matches(request: ReadAction | UpdateAction, connection_id: str, platform: str) -> bool:
    return request.connection_id in (None, connection_id) and request.platform in (None, platform)


def _live_parts(document_id: str) -> tuple[str, str]:
    connection_id, _, external_id = document_id.removeprefix(_LIVE_PREFIX).partition(":")
    if not connection_id or not external_id:
        raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no document {document_id}")
    return connection_id, external_id


def _document_id(connection: KnowledgeConnection, external_id: str) -> str:
    """The id search answers for this platform document: indexed, or live."""
    if connection.rag_enabled:
        return indexed_document_id(connection.id, external_id)
    return live_document_id(connection.id, external_id)


def _may_see(connection: KnowledgeConnection, acl: tuple[str, ...] | None, principal: Principal | None) -> bool:
    if connection.skip_acl or acl is None:
        return True
    return principal is not None and bool(set(acl) & set(principal.principals()))
