"""IMA for the knowledge tool: a note read whole (with the connector's 5-minute negative cache), and
a knowledge base browsed by folder (``get_knowledge_list``, one cursor page at a time)."""

from __future__ import annotations

from pydantic import ValidationError
from typing_extensions import override

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.connectors.ima import FOLDER_PREFIX, MEDIA_TYPES, NOTE, ImaClient, ImaConfig, ImaConnector
from ragstream.direct.ima import NOTE_PREFIX, NOTEBOOK
from ragstream.knowledge.models import ErrorCode, FolderRef
from ragstream.knowledge.platforms import KnowledgeFailure, ListedEntry, Listing, PlatformDocument, PlatformOperations
from ragstream.storage.knowledge import KnowledgeConnection
from ragstream.vendor_http import RetryPolicy

__all__ = ["ImaOperations"]


class ImaOperations(PlatformOperations):
    """``external_id`` is ``<kb_id>/<media_id>`` for an item of a base, ``note/<note_id>`` for a
    notebook note (as the connector and the live search make them). Only notes can be read."""

    platform = "ima"

    def __init__(self, connection_id: str, client: ImaClient, settings: ImaConfig) -> None:
        self._client = client
        self._settings = settings
        # The connector reads a note as a sync does, behind the same per-process negative cache.
        self._connector = ImaConnector(connection_id, "", client, settings)

    @classmethod
    def from_connection(cls, connection: KnowledgeConnection, *, timeout_s: float, retry: RetryPolicy) -> ImaOperations:
        client_id, api_key = connection.credentials.get("client_id"), connection.credentials.get("api_key")
        if client_id is None or api_key is None or not client_id.get_secret_value() or not api_key.get_secret_value():
            raise ValueError(f"ima connection {connection.id} needs credentials client_id, api_key")
        try:
            settings = ImaConfig.model_validate(connection.config)
        except ValidationError:
            raise ValueError(f"ima connection {connection.id}: invalid config (base_url, knowledge_base_ids)") from None
        client = ImaClient(client_id, api_key, base_url=settings.base_url, timeout_s=timeout_s, retry=retry)
        return cls(connection.id, client, settings)

    @override
    async def aclose(self) -> None:
        await self._client.aclose()

    @override
    async def read(self, external_id: str) -> PlatformDocument:
        if external_id.startswith(NOTE_PREFIX):
            note_id = external_id.removeprefix(NOTE_PREFIX)
            text = await self._client.note_markdown(note_id)
            return PlatformDocument(external_id, note_id, text, NOTEBOOK)
        kb_id, _, media_id = external_id.partition("/")
        if not kb_id or not media_id:
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no IMA item {external_id!r} (expected kb_id/media_id)")
        self._check_base(kb_id)
        item = SourceItem(
            external_id, media_id, f"ima://{external_id}", "text/markdown", metadata={"media_id": media_id}
        )
        try:
            content = await self._connector.fetch(item)
        except DocumentVanished:
            raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"IMA item {media_id} no longer exists") from None
        except DocumentUnreadable as failure:
            code = ErrorCode.FORBIDDEN if failure.code == "permission_denied" else ErrorCode.PLATFORM_ERROR
            raise KnowledgeFailure(code, failure.message) from None
        return PlatformDocument(external_id, media_id, content.decode(), kb_id)

    @override
    async def list_documents(
        self, knowledge_base_id: str | None, folder_id: str | None, cursor: str | None, limit: int
    ) -> Listing:
        if knowledge_base_id is None:
            if folder_id is not None:
                raise KnowledgeFailure(ErrorCode.INVALID_REQUEST, "folder_id needs the knowledge_base_id it is in")
            return Listing(await self._bases())
        self._check_base(knowledge_base_id)
        page = await self._client.knowledge_page(
            knowledge_base_id, folder_id=folder_id, cursor=cursor or "", limit=limit
        )
        entries = []
        for item in page.get("knowledge_list") or []:
            media_id = str(item.get("media_id") or "") if isinstance(item, dict) else ""
            if not media_id:
                continue
            title = str(item.get("title") or media_id)
            if media_id.startswith(FOLDER_PREFIX):
                entries.append(ListedEntry("folder", media_id, title))
                continue
            kind = item.get("media_type")
            name = MEDIA_TYPES.get(kind, f"type_{kind}") if isinstance(kind, int) else "unknown"
            readable = f"{knowledge_base_id}/{media_id}" if kind == NOTE else None
            entries.append(ListedEntry("document", media_id, title, readable, name))
        path = [
            FolderRef(folder_id=str(step.get("folder_id")), name=str(step.get("name") or step.get("folder_id")))
            for step in page.get("current_path") or []
            if isinstance(step, dict) and step.get("folder_id")
        ]
        following = page.get("next_cursor")
        next_cursor = following if isinstance(following, str) and following and page.get("is_end") is not True else None
        return Listing(entries, knowledge_base_id, folder_id, path, next_cursor)

    async def _bases(self) -> list[ListedEntry]:
        if self._settings.knowledge_base_ids is not None:
            found = [await self._client.knowledge_base(kb_id) for kb_id in self._settings.knowledge_base_ids]
            pairs = zip(self._settings.knowledge_base_ids, found, strict=True)
            return [
                ListedEntry("knowledge_base", kb, str(info.get("kb_name") or info.get("name") or kb))
                for kb, info in pairs
            ]
        entries = []
        async for info in self._client.knowledge_bases():
            kb_id = info.get("kb_id") or info.get("id")  # Conflict in the sources: both names are seen
            if kb_id:
                entries.append(
                    ListedEntry("knowledge_base", str(kb_id), str(info.get("kb_name") or info.get("name") or kb_id))
                )
        return entries

    def _check_base(self, kb_id: str) -> None:
        bases = self._settings.knowledge_base_ids
        if bases is not None and kb_id not in bases:
            raise KnowledgeFailure(ErrorCode.FORBIDDEN, f"knowledge base {kb_id} is not one of this connection's")
