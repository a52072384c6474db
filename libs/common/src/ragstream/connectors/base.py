"""The contract every connector implements: a cheap listing, full text on demand, deletions by omission.

A sync compares the listing with what is committed: items whose cheap ``source_version`` or content
hash is unchanged are skipped, and committed documents missing from a complete listing are deleted.
The ``source_version`` is what makes a forward (incremental) sync cheap: a platform's modified time or
revision, a file's mtime and size; only an item whose version moved is downloaded, and its SHA-256
then decides whether it really changed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ragstream.core.errors import DocumentError

__all__ = [
    "ClosingConnector",
    "Connector",
    "DocumentUnreadable",
    "DocumentVanished",
    "SkippingConnector",
    "SourceItem",
]


class DocumentVanished(DocumentError):
    """The item was listed but is gone when fetched (deleted mid-sync); it counts as deleted."""


class DocumentUnreadable(DocumentError):
    """The platform refused this one document (no permission on it, an error that outlasted the
    retries): it is recorded failed with ``code`` and ``message`` while the sync goes on. Raised
    instead of a platform error so that one document never fails a whole sync; ``retryable`` says
    whether the next sync or a replay may succeed without anyone changing anything."""

    def __init__(self, code: str, message: str, *, retryable: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class SourceItem:
    """One document as listed. ``acl`` names the principals allowed to read it ('user:<id>',
    'group:<id>'); None lets everyone who can see the connection read it. A listing carries the ACL
    so that a permission-only change reaches the index without the content being read again."""

    external_id: str
    title: str
    source: str
    media_type: str
    source_version: str | None = None
    size: int | None = None
    acl: tuple[str, ...] | None = None
    knowledge_base: str = ""
    url: str | None = None
    metadata: Mapping[str, str | int | float | bool] = field(default_factory=dict)


class Connector(Protocol):
    @property
    def connection_id(self) -> str: ...

    @property
    def platform(self) -> str: ...

    @property
    def name(self) -> str: ...

    def list_items(self) -> AsyncIterator[SourceItem]:
        """Every document at the origin, with version info that costs nothing to read, in ascending
        ``external_id`` order: an interrupted walk resumes after the last id it finished. A listing
        found out of order is walked in full, as if no walk had been interrupted (and logged)."""
        ...

    async def fetch(self, item: SourceItem) -> bytes:
        """The raw content of one listed item; raises ``DocumentVanished`` if it is gone and
        ``DocumentUnreadable`` if the platform refuses this item alone."""
        ...


@runtime_checkable
class ClosingConnector(Protocol):
    """A connector holding connections to its platform (an HTTP pool): the fetch stage closes them
    at the end of every walk, and the connector reopens them if it is used again."""

    async def aclose(self) -> None: ...


@runtime_checkable
class SkippingConnector(Protocol):
    """A connector that leaves entries out of its listing for a reason (a symlink, a special file):
    ``skipped`` counts them by reason for the latest listing, and the sync reports the counts."""

    @property
    def skipped(self) -> Mapping[str, int]: ...
