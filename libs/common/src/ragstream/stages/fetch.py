"""Fetch stage: reconcile a connector's listing with the committed state and announce the differences."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ragstream.connectors.base import Connector, DocumentVanished, SourceItem
from ragstream.failures import StageFailure, record_failure
from ragstream.messages import DocumentChanged, DocumentDeleted, DocumentHeader
from ragstream.parsing import ParseErrorCode
from ragstream.storage.documents import CommittedDocument, DocumentStore, document_id

__all__ = ["ChangeSink", "ConfiguredConnector", "FetchService", "SyncCounts"]


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


@dataclass(slots=True)
class SyncCounts:
    seen: int = 0
    unchanged: int = 0
    changed: int = 0
    deleted: int = 0
    failed: int = 0
    acl_updated: int = 0
    changed_ids: list[str] = field(default_factory=list)


class FetchService:
    """Walks the listing once; unchanged items cost a dictionary lookup, changed ones are staged.

    Content is staged in PostgreSQL before its message is published, so a consumer never sees a
    reference to bytes that are not durable. Deletions are found by omission from the listing, which
    also heals lost messages: anything not committed is simply announced again on the next sync.
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

    async def run(self, sink: ChangeSink) -> SyncCounts:
        connector = self._connector
        config = connector.config if isinstance(connector, ConfiguredConnector) else None
        await self._store.ensure_connection(connector.connection_id, connector.platform, connector.name, config)
        committed = await self._store.committed(connector.connection_id)
        counts = SyncCounts()
        listed: set[str] = set()
        async for item in connector.list_items():
            counts.seen += 1
            if await self._process(item, committed.get(item.external_id), sink, counts):
                listed.add(item.external_id)
            if self._on_item:
                await self._on_item(counts)
        for external_id, gone in committed.items():
            if external_id not in listed:
                await self._announce_deleted(gone, sink)
                counts.deleted += 1
        # A document that never indexed and is gone at the source has nothing to delete but its failure.
        await self._store.forget_failures_except(
            connector.connection_id, [document_id(connector.connection_id, external_id) for external_id in listed]
        )
        return counts

    async def _process(
        self, item: SourceItem, known: CommittedDocument | None, sink: ChangeSink, counts: SyncCounts
    ) -> bool:
        """Handle one listed item; False when it vanished and must be treated as deleted."""
        acl = sorted(set(item.acl)) if item.acl is not None else None
        if known and acl != (sorted(known.acl) if known.acl is not None else None):
            # Permissions changed: rewrite the chunks' ACL now, without re-reading or re-embedding.
            # A revoked reader loses access at once, even while a new version is still on its way.
            await self._store.update_acl(known.document_id, acl)
            counts.acl_updated += 1
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
        except OSError as error:
            await self._fail(item, header_id, "unreadable", f"cannot read: {error.strerror or error}")
            counts.failed += 1
            return True
        content_hash = hashlib.sha256(content).hexdigest()
        if known and known.content_hash == content_hash:
            # Same bytes, new mtime (a touch, a checkout): remember it so the next sync skips the read.
            await self._store.remember_source_version(known.document_id, item.source_version)
            counts.unchanged += 1
            return True
        version = await self._store.stage(header_id, content)
        await sink.changed(DocumentChanged(header=self._header(item, header_id, version, content_hash)))
        counts.changed += 1
        counts.changed_ids.append(header_id)
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

    async def _fail(self, item: SourceItem, header_id: str, code: str, message: str) -> None:
        version = await self._store.next_version()
        header = self._header(item, header_id, version, "")
        await record_failure(self._store, header, "fetch", StageFailure(code, message, retryable=False))

    async def _announce_deleted(self, gone: CommittedDocument, sink: ChangeSink) -> None:
        await sink.deleted(
            DocumentDeleted(
                document_id=gone.document_id,
                connection_id=self._connector.connection_id,
                external_id=gone.external_id,
                source=gone.source,
                version=await self._store.next_version(),
            )
        )
