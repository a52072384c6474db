"""Which knowledge-tool operation each platform supports, and the per-platform code behind the ones
beyond the index: reading a live (direct-search) document, browsing IMA by folder, writing to Yuque.

| platform | search | read | list_documents | create / update |
|---|---|---|---|---|
| folder, web, feishu, lark | yes | yes (indexed; a live Feishu hit: no) | no | no |
| yuque | yes | yes | no | yes |
| ima | yes | yes | yes | no |
| dingtalk | yes | yes | no | no |

Why the "no"s: Feishu's documented grants are read-only (``wiki:wiki:readonly``,
``docx:document:readonly``, …) and no document write API is documented to us; IMA's ``import_doc``
and ``append_doc`` have no documented fields; DingTalk's adapter has no write implementation (the
product documents' own refusal text); folders and websites are sources, not places to write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragstream.core.errors import RagstreamError
from ragstream.knowledge.models import Action, ErrorCode, FolderRef

__all__ = [
    "OPERATIONS",
    "KnowledgeFailure",
    "ListedEntry",
    "Listing",
    "PlatformDocument",
    "PlatformOperations",
    "WrittenDocument",
    "refusal",
    "supports",
]

_READ_ONLY: frozenset[Action] = frozenset({"search", "read"})

#: The operations of each platform (a platform not listed: search and read).
OPERATIONS: dict[str, frozenset[Action]] = {
    "folder": _READ_ONLY,
    "web": _READ_ONLY,
    "feishu": _READ_ONLY,
    "lark": _READ_ONLY,
    "yuque": _READ_ONLY | {"create", "update"},
    "ima": _READ_ONLY | {"list_documents"},
    "dingtalk": _READ_ONLY,
}


def supports(platform: str, action: Action) -> bool:
    return action in OPERATIONS.get(platform, _READ_ONLY)


def refusal(platform: str, action: Action) -> str:
    """The refusal of ``action`` on ``platform``; for create, the product documents' exact words."""
    if action == "create":
        return f"Platform '{platform}' does not support document creation"
    if action == "update":
        return f"Platform '{platform}' does not support document updates"
    if action == "list_documents":
        return f"Platform '{platform}' does not support list_documents (only IMA is browsed by folder); use search"
    return f"Platform '{platform}' does not support {action}"


class KnowledgeFailure(RagstreamError):
    """An operation's structured error: ``code`` and a message without secrets."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class PlatformDocument:
    """A whole document read from its platform; ``acl`` as on a chunk (None: everyone who can see the
    connection)."""

    external_id: str
    title: str
    text: str
    knowledge_base: str
    url: str | None = None
    acl: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class WrittenDocument:
    external_id: str
    title: str
    knowledge_base: str
    url: str | None = None


@dataclass(frozen=True, slots=True)
class ListedEntry:
    kind: str
    id: str
    title: str
    #: The platform id read opens, for a document it can read.
    external_id: str | None = None
    media_type: str | None = None


@dataclass(frozen=True, slots=True)
class Listing:
    entries: list[ListedEntry]
    knowledge_base_id: str | None = None
    folder_id: str | None = None
    path: list[FolderRef] = field(default_factory=list)
    next_cursor: str | None = None


class PlatformOperations:
    """One connection's operations on its platform; each one a platform lacks raises
    ``unsupported_operation``. Its HTTP pool lives until ``aclose``."""

    platform = ""

    async def read(self, external_id: str) -> PlatformDocument:
        raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(self.platform, "read"))

    async def list_documents(
        self, knowledge_base_id: str | None, folder_id: str | None, cursor: str | None, limit: int
    ) -> Listing:
        raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(self.platform, "list_documents"))

    async def target(self, knowledge_base: str | None) -> tuple[str, tuple[str, ...] | None]:
        """Where a create goes (``knowledge_base`` or the connection's default) and the ACL of that
        place: who may write there."""
        raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(self.platform, "create"))

    async def create(self, knowledge_base: str, title: str, body: str) -> WrittenDocument:
        raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(self.platform, "create"))

    async def update(self, external_id: str, title: str | None, body: str) -> WrittenDocument:
        raise KnowledgeFailure(ErrorCode.UNSUPPORTED_OPERATION, refusal(self.platform, "update"))

    async def aclose(self) -> None:
        return None
