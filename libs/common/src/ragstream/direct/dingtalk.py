"""DingTalk live search: dentry search, with the first paragraphs of online documents as their text.

The search answers metadata only (``docs/platform-apis.md``, DingTalk search), so the first
``PREVIEW_READS`` hits that are online (ALIDOC) documents are read through their blocks; a hit whose
blocks cannot be read (a PDF or Office file, view-only access) keeps its name as its text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from ragstream.connectors.dingtalk import DINGTALK_BASE_URL, DingTalkClient, DingTalkError
from ragstream.direct.base import LiveHit
from ragstream.vendor_http import RetryPolicy

__all__ = ["DOCUMENT_URL", "DingTalkConfig", "DingTalkSearcher", "block_text"]

#: Hits whose blocks are read for their text: each read is one more call inside the search's time.
PREVIEW_READS = 5
#: ASSUMPTION: the search answers no link; online documents open at this address by dentry uuid.
DOCUMENT_URL = "https://alidocs.dingtalk.com/i/nodes/{uuid}"


class DingTalkConfig(BaseModel):
    """The keys of a ``dingtalk`` connection's config the searcher reads."""

    model_config = ConfigDict(extra="ignore")

    base_url: str = Field(default=DINGTALK_BASE_URL, description="The OpenAPI host")


class DingTalkSearcher:
    def __init__(self, client: DingTalkClient, knowledge_base: str) -> None:
        self._client = client
        self._knowledge_base = knowledge_base

    @classmethod
    def from_connection(
        cls,
        connection_id: str,
        name: str,
        config: Mapping[str, Any],
        credentials: Mapping[str, SecretStr],
        *,
        timeout_s: float,
        retry: RetryPolicy,
    ) -> DingTalkSearcher:
        """``ValueError`` (naming fields, never values of secrets) when the connection cannot make one."""
        needed = ("app_key", "app_secret", "operator_union_id")
        missing = [key for key in needed if not (credentials.get(key) or SecretStr("")).get_secret_value()]
        if missing:
            raise ValueError(f"dingtalk connection {connection_id} needs credentials {', '.join(missing)}")
        try:
            settings = DingTalkConfig.model_validate(config)
        except ValidationError:
            raise ValueError(f"dingtalk connection {connection_id}: invalid config (base_url)") from None
        client = DingTalkClient(
            credentials["app_key"],
            credentials["app_secret"],
            credentials["operator_union_id"].get_secret_value(),
            base_url=settings.base_url,
            timeout_s=timeout_s,
            retry=retry,
        )
        return cls(client, name)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def search(self, query: str, wanted: int) -> list[LiveHit]:
        dentries = [
            dentry async for dentry in self._client.search(query, wanted) if isinstance(dentry.get("dentryUuid"), str)
        ]
        texts = await asyncio.gather(*(self._text(dentry["dentryUuid"]) for dentry in dentries[:PREVIEW_READS]))
        hits: list[LiveHit] = []
        for position, dentry in enumerate(dentries):
            uuid, name = dentry["dentryUuid"], str(dentry.get("name") or dentry["dentryUuid"])
            text = texts[position] if position < len(texts) else None
            hits.append(
                LiveHit(
                    external_id=uuid,
                    title=name,
                    text=text or name,
                    knowledge_base=self._knowledge_base,
                    url=DOCUMENT_URL.format(uuid=quote(uuid, safe="")),
                )
            )
        return hits

    async def _text(self, uuid: str) -> str | None:
        """The text of the document's first blocks, or None when it has none to give."""
        try:
            blocks = await self._client.blocks(uuid)
        except DingTalkError:
            return None
        lines = [block_text(block) for block in blocks]
        return "\n\n".join(line for line in lines if line) or None


def block_text(block: Mapping[str, Any]) -> str:
    for kind in ("paragraph", "heading"):
        part = block.get(kind)
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            return str(part["text"]).strip()
    return ""
