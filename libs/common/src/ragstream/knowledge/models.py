"""The knowledge tool's requests (one model per action, told apart by ``action``) and its answer: a
result or a structured error, never both."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from ragstream.core.search import ChatTurn, Principal, SearchFilters, SearchResponse
from ragstream.core.storable import Storable, StorableStr
from ragstream.retrieval.reader import DocumentRead

__all__ = [
    "MAX_BODY_CHARS",
    "Action",
    "CreateAction",
    "DocumentEntry",
    "DocumentList",
    "DocumentWritten",
    "ErrorCode",
    "FolderRef",
    "IndexingState",
    "KnowledgeError",
    "KnowledgeRequest",
    "KnowledgeResponse",
    "ListDocumentsAction",
    "ReadAction",
    "SearchAction",
    "UpdateAction",
    "elided_body",
]

Action = Literal["search", "read", "list_documents", "create", "update"]

#: A written body is at most this long (the request body limit applies first).
MAX_BODY_CHARS = 500_000

# Lines that stand for text left out: the mark of a summary or an excerpt, not a full body.
_ELISION = re.compile(
    r"^\s*(?:\.{3,}|…+|\[\s*(?:\.{3}|…)\s*\]|\(\s*(?:\.{3}|…)\s*\)"
    r"|[(\[<!-]*\s*(?:rest|remainder)\s+(?:of\s+(?:the\s+)?(?:document|content|text)\s+)?(?:is\s+)?unchanged\b.*"
    r"|[(\[<!-]*\s*(?:same\s+as\s+(?:before|above)|content\s+unchanged|unchanged\s+content)\b.*"
    r"|[（(\[]?\s*(?:其余|其他|以下|下同|内容)(?:内容)?(?:不变|同上|省略|略)\s*[）)\]]?.*)\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_SUMMARY_LEAD = re.compile(r"^\s*(?:#+\s*)?(?:summary|tl;?dr|摘要|总结|概要)\s*[:：]", re.IGNORECASE)
# Code keeps its ``...`` (a Python stub, an elided log): only prose outside fences is checked.
_FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)


def elided_body(body: str) -> str | None:
    """Why ``body`` is not a full document body (empty, a summary, text elided), or None."""
    if not body.strip():
        return "the body is empty"
    if _SUMMARY_LEAD.match(body):
        return "the body starts as a summary"
    found = _ELISION.search(_FENCED.sub("", body))
    if found is not None:
        return f"the body leaves text out ({found.group(0).strip()[:40]!r})"
    return None


class ErrorCode(StrEnum):
    """What went wrong, for the caller to act on."""

    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_OPERATION = "unsupported_operation"
    NOT_FOUND = "not_found"
    AMBIGUOUS_CONNECTION = "ambiguous_connection"
    FORBIDDEN = "forbidden"
    PLATFORM_ERROR = "platform_error"
    PLATFORM_UNAVAILABLE = "platform_unavailable"
    UNAVAILABLE = "unavailable"
    NOT_SERVED_HERE = "not_served_here"
    INTERNAL = "internal"


class KnowledgeError(BaseModel):
    code: Annotated[ErrorCode, Field(title="Error code")]
    message: Annotated[str, Field(title="What went wrong and what to do", description="Never a secret.")]


class _Call(BaseModel):
    """What every action may name: where it goes, who asks, and the conversation it belongs to."""

    platform: Annotated[
        StorableStr | None,
        Field(
            title="Platform", description="folder, feishu, lark, yuque, ima, dingtalk, web; none: every one (search)"
        ),
    ] = None
    connection_id: Annotated[StorableStr | None, Field(title="Connection")] = None
    conversation_id: Annotated[
        str | None,
        Field(
            title="Conversation",
            description="Citation numbers and the empty-search hint are kept per conversation.",
            max_length=200,
        ),
        Storable,
    ] = None
    principal: Annotated[
        Principal | None,
        Field(title="Caller", description="The user the expert acts for; required by create and update."),
    ] = None


class SearchAction(_Call):
    action: Literal["search"]
    query: Annotated[str, Field(title="Query", min_length=1, max_length=4000), Storable]
    top_k: Annotated[int, Field(title="Results to return", ge=1, le=30)] = 10
    filters: Annotated[
        SearchFilters, Field(title="Scope", description="As POST /v1/search; platform and connection_id narrow it.")
    ] = SearchFilters()
    history: Annotated[list[ChatTurn], Field(title="Conversation so far")] = []


class ReadAction(_Call):
    action: Literal["read"]
    document_id: Annotated[StorableStr, Field(title="Document", description="A document_id a search answered.")]


class ListDocumentsAction(_Call):
    action: Literal["list_documents"]
    knowledge_base_id: Annotated[
        StorableStr | None, Field(title="Knowledge base", description="None: list the knowledge bases.")
    ] = None
    folder_id: Annotated[StorableStr | None, Field(title="Folder", description="None: the base's root.")] = None
    cursor: Annotated[StorableStr | None, Field(title="Cursor", description="next_cursor of the previous page.")] = None
    limit: Annotated[int, Field(title="Entries per page", ge=1, le=50)] = 50


class _Write(_Call):
    body: Annotated[
        str,
        Field(
            title="Full body (Markdown)",
            description="The whole document as it is to be stored, never a summary or an excerpt.",
            max_length=MAX_BODY_CHARS,
        ),
        Storable,
    ]

    @field_validator("body")
    @classmethod
    def _full(cls, body: str) -> str:
        problem = elided_body(body)
        if problem is not None:
            raise ValueError(f"{problem}: pass the full document body, not a summary")
        return body


class CreateAction(_Write):
    action: Literal["create"]
    knowledge_base: Annotated[
        StorableStr | None,
        Field(title="Where", description="Yuque: the repo namespace group/book; none: the connection's only repo."),
    ] = None
    title: Annotated[str, Field(title="Title", min_length=1, max_length=200), Storable]


class UpdateAction(_Write):
    action: Literal["update"]
    document_id: Annotated[StorableStr, Field(title="Document", description="A document_id a search answered.")]
    title: Annotated[str | None, Field(title="New title", min_length=1, max_length=200), Storable] = None
    shorten: Annotated[
        bool,
        Field(
            title="Shorten on purpose",
            description="A body under a quarter of the current one is refused as a likely summary unless set.",
        ),
    ] = False


KnowledgeRequest = Annotated[
    SearchAction | ReadAction | ListDocumentsAction | CreateAction | UpdateAction, Field(discriminator="action")
]


class FolderRef(BaseModel):
    folder_id: str
    name: str


class DocumentEntry(BaseModel):
    """One entry of a knowledge base's folder."""

    kind: Annotated[Literal["knowledge_base", "folder", "document"], Field(title="Kind")]
    id: Annotated[str, Field(title="Id", description="knowledge_base_id, folder_id, or the platform's media id.")]
    title: str
    document_id: Annotated[
        str | None, Field(title="Document id to read", description="Set for a document read can open.")
    ] = None
    media_type: Annotated[str | None, Field(title="Media type", description="note, pdf, ... for a document.")] = None


class DocumentList(BaseModel):
    connection_id: str
    platform: str
    knowledge_base_id: str | None = None
    folder_id: str | None = None
    path: Annotated[list[FolderRef], Field(title="Folders from the base's root down to this one")] = []
    entries: list[DocumentEntry]
    next_cursor: Annotated[str | None, Field(title="Cursor of the next page; none at the end")] = None


IndexingState = Literal["sync_started", "sync_running", "live"]


class DocumentWritten(BaseModel):
    connection_id: str
    platform: str
    document_id: Annotated[str, Field(title="Document id", description="For read and update, as search answers it.")]
    knowledge_base: str
    title: str
    url: str | None = None
    indexing: Annotated[
        IndexingState,
        Field(
            title="How the written text reaches search",
            description="sync_started: a sync of the connection was started now; sync_running: one was running, "
            "the next picks it up; live: the connection is searched live (RAG off).",
        ),
    ]


class KnowledgeResponse(BaseModel):
    """Exactly one of the result fields, or ``error``."""

    action: Annotated[str, Field(title="The action answered")]
    search: SearchResponse | None = None
    read: DocumentRead | None = None
    documents: DocumentList | None = None
    written: DocumentWritten | None = None
    error: KnowledgeError | None = None
    hint: Annotated[
        str | None,
        Field(title="Advice for the expert", description="After two searches in a row found nothing: how to sync."),
    ] = None
