"""DingTalk for the knowledge tool: an online (ALIDOC) document read whole through its blocks. No
writes: the adapter has none (the product documents' refusal text)."""

from __future__ import annotations

from urllib.parse import quote

from pydantic import ValidationError
from typing_extensions import override

from ragstream.connectors.dingtalk import DingTalkClient
from ragstream.direct.dingtalk import DOCUMENT_URL, DingTalkConfig, block_text
from ragstream.knowledge.models import ErrorCode
from ragstream.knowledge.platforms import KnowledgeFailure, PlatformDocument, PlatformOperations
from ragstream.storage.knowledge import KnowledgeConnection
from ragstream.vendor_http import RetryPolicy

__all__ = ["MAX_BLOCKS", "DingTalkOperations"]

#: Blocks read for one document: a read is bounded like every parser.
MAX_BLOCKS = 5000


class DingTalkOperations(PlatformOperations):
    """``external_id`` is the dentry uuid, as the live search makes it."""

    platform = "dingtalk"

    def __init__(self, client: DingTalkClient, knowledge_base: str) -> None:
        self._client = client
        self._knowledge_base = knowledge_base

    @classmethod
    def from_connection(
        cls, connection: KnowledgeConnection, *, timeout_s: float, retry: RetryPolicy
    ) -> DingTalkOperations:
        credentials = connection.credentials
        needed = ("app_key", "app_secret", "operator_union_id")
        missing = [key for key in needed if key not in credentials or not credentials[key].get_secret_value()]
        if missing:
            raise ValueError(f"dingtalk connection {connection.id} needs credentials {', '.join(missing)}")
        try:
            settings = DingTalkConfig.model_validate(connection.config)
        except ValidationError:
            raise ValueError(f"dingtalk connection {connection.id}: invalid config (base_url)") from None
        client = DingTalkClient(
            credentials["app_key"],
            credentials["app_secret"],
            credentials["operator_union_id"].get_secret_value(),
            base_url=settings.base_url,
            timeout_s=timeout_s,
            retry=retry,
        )
        return cls(client, connection.name)

    @override
    async def aclose(self) -> None:
        await self._client.aclose()

    @override
    async def read(self, external_id: str) -> PlatformDocument:
        blocks = await self._client.blocks(external_id, end_index=MAX_BLOCKS)
        lines = [line for line in (block_text(block) for block in blocks) if line]
        if not lines:
            raise KnowledgeFailure(
                ErrorCode.PLATFORM_ERROR, f"DingTalk gives no text for {external_id}: only online documents can be read"
            )
        url = DOCUMENT_URL.format(uuid=quote(external_id, safe=""))
        return PlatformDocument(external_id, external_id, "\n\n".join(lines), self._knowledge_base, url)
