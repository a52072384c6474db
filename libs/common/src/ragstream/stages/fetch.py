"""Fetch stage (the downloader): reconcile a connector's listing with the committed state, stage what
changed and announce it; resume an interrupted walk from its cursor and the staging store."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ragstream.connectors.base import (
    ClosingConnector,
    Connector,
    DocumentUnreadable,
    DocumentVanished,
    SkippingConnector,
    SourceItem,
)
from ragstream.failures import StageFailure, record_failure
from ragstream.logs import log_context
from ragstream.messages import DocumentChanged, DocumentDeleted, DocumentHeader
from ragstream.parsing import ParseErrorCode
from ragstream.storage.cursors import Direction
from ragstream.storage.documents import CommittedDocument, DocumentStore, document_id

__all__ = ["ChangeSink", "ConfiguredConnector", "FetchService", "SyncCounts"]

logger = logging.getLogger(__name__)


class ChangeSink(Protocol):
    """Where announced changes go: Kafka topics in the services, a local queue in the embedded runner."""

    async def changed(self, message: DocumentChanged) -> None: ...

    async def deleted(self, message: DocumentDeleted) -> None: ...


@runtime_checkable
class ConfiguredConnector(Protocol):
    """A connector that carries its connection's config (``{"chunking": {...}}``) to store on sync;
    ``None`` keeps what is stored. Optional, so connectors without options need nothing."""

    @property
    def config(self) -> Mapping[str, Any] | None: ...


# A walk writes its cursor after every download (a download costs far more than the write) and
# otherwise at most this often: a cursor that lags only makes a resumed walk examine a few items again
# (and, for a listing without cheap versions, download them to compare hashes).
_CURSOR_INTERVAL_S = 1.0


@dataclass(slots=True)
class SyncCounts:
    seen: int = 0
    unchanged: int = 0
    changed: int = 0
    deleted: int = 0
    failed: int = 0
    acl_updated: int = 0
    # Announced from the staging store: downloaded by an interrupted sync, never indexed.
    restaged: int = 0
    # Contents read from the source (changed or not): what the cheap versions and the cursor save.
    downloaded: int = 0
    direction: Direction | None = None
    resumed: bool = False
    # Entries the connector left out, by reason (symlink, special_file, unreadable).
    skipped: dict[str, int] = field(default_factory=dict)
    # The (document id, version) of every change announced: what a Kafka-mode run waits for.
    announced: list[tuple[str, int]] = field(default_factory=list)


class FetchService:
    """Walks the listing once; unchanged items cost a dictionary lookup, changed ones are staged.

    Content is staged in PostgreSQL before its message is published, so a consumer never sees a
    reference to bytes that are not durable. Deletions are found by omission from the listing, which
    also heals lost messages: anything not committed is simply announced again on the next sync.

    The walk keeps a ``download`` cursor (the last external id it finished). A sync that stopped
    midway leaves it unfinished, and the next one resumes it: what the stopped walk staged but never
    indexed is announced again from the staging store (an item without a cheap version is downloaded
    again first: it may have been edited meanwhile), and committed items up to the cursor whose
    listing has no cheap version are not downloaded again (their edits since are found by the next,
    forward walk). Everything else is examined as in any walk: new items, and items with a cheap
    version, whose comparison costs no download. The whole listing is still walked: it is cheap, and
    deletions need all of it.
    """

    def __init__(
        self,
        store: DocumentStore,
        connector: Connector,
        *,
        max_document_bytes: int,
        on_item: Callable[[SyncCounts], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        self._connector = connector
        self._max_bytes = max_document_bytes
        self._on_item = on_item

    async def register(self) -> None:
        """Store the connection (and its config): call once before ``run``, whose cursors reference it."""
        connector = self._connector
        config = connector.config if isinstance(connector, ConfiguredConnector) else None
        await self._store.ensure_connection(connector.connection_id, connector.platform, connector.name, config)

    async def run(self, sink: ChangeSink, *, index_unfinished: bool = False) -> SyncCounts:
        """One walk of the listing. ``index_unfinished``: the index side of the previous sync stopped
        before it had indexed everything staged, so staged versions are announced again even if the
        download walk itself had completed. A connector holding platform connections has them closed
        at the end of the walk, whichever way it ends: every download happens within the walk.
        Everything logged meanwhile carries the connection's id, and the document's while it is handled."""
        try:
            with log_context(connection_id=self._connector.connection_id):
                return await self._walk(sink, index_unfinished)
        finally:
            if isinstance(self._connector, ClosingConnector):
                await self._connector.aclose()

    async def _walk(self, sink: ChangeSink, index_unfinished: bool) -> SyncCounts:
        connection_id = self._connector.connection_id
        cursors = self._store.cursors
        walk = await cursors.begin(connection_id, "download")
        resuming = walk.resumed or index_unfinished
        staged = await self._store.pending_staged(connection_id) if resuming else {}
        committed = await self._store.committed(connection_id)
        counts = SyncCounts(direction=walk.direction, resumed=resuming)
        listed: set[str] = set()
        written = time.monotonic()
        # The cursor is a position in ascending external id order; a listing out of that order
        # would make it skip items never walked, so from the first id out of order it is ignored
        # (every item examined) and no longer moved.
        resume_after, previous, ordered = walk.position, "", True
        async for item in self._connector.list_items():
            counts.seen += 1
            if ordered and item.external_id < previous:
                logger.warning(
                    "connection %s lists %r after %r, out of ascending id order: its download cursor is"
                    " ignored for the rest of this walk",
                    connection_id,
                    item.external_id,
                    previous,
                )
                resume_after, ordered = None, False
            previous = item.external_id
            downloaded = counts.downloaded
            with log_context(document_id=document_id(connection_id, item.external_id)):
                walked = await self._walk_item(
                    item, resume_after, staged.get(item.external_id), committed, sink, counts
                )
            if walked:
                listed.add(item.external_id)
            if ordered and (counts.downloaded > downloaded or time.monotonic() - written >= _CURSOR_INTERVAL_S):
                await cursors.advance(connection_id, "download", item.external_id, counts.seen)
                written = time.monotonic()
            if self._on_item:
                await self._on_item(counts)
        if isinstance(self._connector, SkippingConnector):
            counts.skipped = dict(self._connector.skipped)
        # Staged but never indexed counts as known: a document deleted meanwhile gets its tombstone.
        known = {external_id: _staged_as_known(header) for external_id, header in staged.items()} | committed
        for external_id, gone in known.items():
            if external_id not in listed:
                await self._announce_deleted(gone, sink)
                counts.deleted += 1
        # A document that never indexed and is gone at the source has nothing to delete but its failure.
        await self._store.forget_failures_except(
            connection_id, [document_id(connection_id, external_id) for external_id in listed]
        )
        await cursors.complete(connection_id, "download", counts.seen)
        return counts

    async def _walk_item(
        self,
        item: SourceItem,
        resume_after: str | None,
        staged: DocumentHeader | None,
        committed: dict[str, CommittedDocument],
        sink: ChangeSink,
        counts: SyncCounts,
    ) -> bool:
        """Where one listed item goes; False when it vanished and must be treated as deleted."""
        if staged is not None:
            if item.source_version is not None and staged.source_version == item.source_version:
                # Downloaded by the interrupted sync and not changed since: index it from staging.
                await self._restage(item, staged, sink, counts)
                return True
            # Changed since it was staged, or without a cheap version to tell (it may have been edited
            # while the sync was down): download it again, wherever the cursor stands.
        elif (
            resume_after is not None
            and item.external_id <= resume_after
            and item.source_version is None
            and (known := committed.get(item.external_id)) is not None
        ):
            # Committed, and finished by the interrupted walk: without a cheap version it would be
            # downloaded again just to compare hashes. Its permissions are still compared (free); an
            # edit since the stopped walk passed it is found by the next, forward walk. Everything else
            # is examined as usual: a new item, and one with a cheap version, which costs no download.
            await self._sync_acl(item, known, counts)
            counts.unchanged += 1
            return True
        return await self._process(item, committed.get(item.external_id), sink, counts, staged)

    async def _restage(self, item: SourceItem, staged: DocumentHeader, sink: ChangeSink, counts: SyncCounts) -> None:
        """Announce the version an interrupted sync staged, from the staging store."""
        header = self._header(item, staged.document_id, staged.version, staged.content_hash)
        await sink.changed(DocumentChanged(header=header))
        counts.changed += 1
        counts.restaged += 1
        counts.announced.append((header.document_id, header.version))

    async def _sync_acl(self, item: SourceItem, known: CommittedDocument, counts: SyncCounts) -> None:
        """Permissions changed: rewrite the chunks' ACL now, without re-reading or re-embedding.
        A revoked reader loses access at once, even while a new version is still on its way."""
        acl = sorted(set(item.acl)) if item.acl is not None else None
        if acl != (sorted(known.acl) if known.acl is not None else None):
            await self._store.update_acl(known.document_id, acl)
            counts.acl_updated += 1

    async def _process(
        self,
        item: SourceItem,
        known: CommittedDocument | None,
        sink: ChangeSink,
        counts: SyncCounts,
        staged: DocumentHeader | None = None,
    ) -> bool:
        """Handle one listed item; False when it vanished and must be treated as deleted. ``staged``:
        the version an interrupted sync staged and never indexed, announced again if the bytes are
        still the same rather than staged a second time."""
        if known:
            await self._sync_acl(item, known, counts)
        if known and item.source_version is not None and item.source_version == known.source_version:
            counts.unchanged += 1
            return True
        header_id = document_id(self._connector.connection_id, item.external_id)
        if item.size is not None and item.size > self._max_bytes:
            await self._fail(
                item, header_id, ParseErrorCode.TOO_LARGE, f"{item.size} bytes is over the limit of {self._max_bytes}"
            )
            counts.failed += 1
            return True
        try:
            content = await self._connector.fetch(item)
        except DocumentVanished:
            return False
        except DocumentUnreadable as error:
            await self._fail(item, header_id, error.code, error.message, retryable=error.retryable)
            counts.failed += 1
            return True
        except OSError as error:
            await self._fail(item, header_id, "unreadable", f"cannot read: {error.strerror or error}")
            counts.failed += 1
            return True
        counts.downloaded += 1
        content_hash = hashlib.sha256(content).hexdigest()
        if known and known.content_hash == content_hash:
            # Same bytes, new mtime (a touch, a checkout): remember it so the next sync skips the read.
            await self._store.remember_source_version(known.document_id, item.source_version)
            counts.unchanged += 1
            return True
        if staged is not None and staged.content_hash == content_hash:
            await self._restage(item, staged, sink, counts)
            return True
        header = self._header(item, header_id, await self._store.next_version(), content_hash)
        await self._store.stage(header, content)
        await sink.changed(DocumentChanged(header=header))
        counts.changed += 1
        counts.announced.append((header_id, header.version))
        return True

    def _header(self, item: SourceItem, header_id: str, version: int, content_hash: str) -> DocumentHeader:
        return DocumentHeader(
            document_id=header_id,
            connection_id=self._connector.connection_id,
            external_id=item.external_id,
            version=version,
            content_hash=content_hash,
            title=item.title,
            source=item.source,
            media_type=item.media_type,
            source_version=item.source_version,
            knowledge_base=item.knowledge_base,
            url=item.url,
            acl=sorted(set(item.acl)) if item.acl is not None else None,
            metadata=dict(item.metadata),
        )

    async def _fail(
        self, item: SourceItem, header_id: str, code: str, message: str, *, retryable: bool = False
    ) -> None:
        version = await self._store.next_version()
        header = self._header(item, header_id, version, "")
        await record_failure(self._store, header, "fetch", StageFailure(code, message, retryable=retryable))

    async def _announce_deleted(self, gone: CommittedDocument, sink: ChangeSink) -> None:
        """A tombstone with a fresh version, which outranks every version staged or committed before."""
        await sink.deleted(
            DocumentDeleted(
                document_id=gone.document_id,
                connection_id=self._connector.connection_id,
                external_id=gone.external_id,
                source=gone.source,
                version=await self._store.next_version(),
            )
        )


def _staged_as_known(header: DocumentHeader) -> CommittedDocument:
    return CommittedDocument(
        header.document_id, header.external_id, header.source, header.content_hash, header.source_version, header.acl
    )
