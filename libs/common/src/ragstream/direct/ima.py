"""IMA live search: ``search_knowledge`` in each knowledge base and ``search_note`` in the key owner's
notebooks, the ``highlight_content`` snippet as the text."""

from __future__ import annotations

import asyncio
import html
import itertools
import re
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr, ValidationError

from ragstream.connectors.ima import ImaClient, ImaConfig
from ragstream.direct.base import LiveHit
from ragstream.vendor_http import RetryPolicy

__all__ = ["NOTEBOOK", "NOTE_PREFIX", "ImaSearcher"]

_TAG = re.compile(r"<[^>]{0,200}>")


#: The knowledge base a notebook note (found by ``search_note``, in no base) is shown under.
NOTEBOOK = "Notes"
#: ``external_id`` prefix of a notebook note: ``note/<note_id>``.
NOTE_PREFIX = "note/"


class ImaSearcher:
    """Within the configured ``knowledge_base_ids``, else every base the key sees (listed on each
    search), and the notebooks (``ImaConfig.searches_notes``); the bases and the notebooks are
    searched concurrently and their hits interleaved, best of each first. ACL: None, as for indexed
    notes (the key owner's view is the connection's)."""

    def __init__(self, client: ImaClient, settings: ImaConfig) -> None:
        self._client = client
        self._settings = settings

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
    ) -> ImaSearcher:
        client_id, api_key = credentials.get("client_id"), credentials.get("api_key")
        if client_id is None or api_key is None or not client_id.get_secret_value() or not api_key.get_secret_value():
            raise ValueError(f"ima connection {connection_id} needs credentials client_id, api_key")
        try:
            settings = ImaConfig.model_validate(config)
        except ValidationError:
            raise ValueError(f"ima connection {connection_id}: invalid config (base_url, knowledge_base_ids)") from None
        client = ImaClient(client_id, api_key, base_url=settings.base_url, timeout_s=timeout_s, retry=retry)
        return cls(client, settings)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def search(self, query: str, wanted: int) -> list[LiveHit]:
        bases = await self._bases()
        searches = [self._client.search_knowledge(query, kb_id) for kb_id, _ in bases]
        if self._settings.searches_notes():
            searches.append(self._client.search_note(query, limit=min(max(wanted, 1), 50)))
        found = await asyncio.gather(*searches)
        per_base = [
            [hit for item in items if (hit := _hit(kb_id, name, item)) is not None]
            for (kb_id, name), items in zip(bases, found, strict=False)
        ]
        if self._settings.searches_notes():
            per_base.append([hit for item in found[-1] if (hit := _note_hit(item)) is not None])
        interleaved = [hit for row in itertools.zip_longest(*per_base) for hit in row if hit is not None]
        return interleaved[:wanted]

    async def _bases(self) -> list[tuple[str, str]]:
        if self._settings.knowledge_base_ids is not None:
            return [(kb_id, kb_id) for kb_id in self._settings.knowledge_base_ids]
        bases = []
        async for info in self._client.knowledge_bases():
            kb_id = info.get("kb_id") or info.get("id")  # Conflict in the sources: both names are seen
            if kb_id:
                bases.append((str(kb_id), str(info.get("kb_name") or info.get("name") or kb_id)))
        return bases


def _hit(kb_id: str, knowledge_base: str, item: Mapping[str, Any]) -> LiveHit | None:
    media_id = item.get("media_id")
    if not isinstance(media_id, str) or not media_id:
        return None
    title = str(item.get("title") or media_id)
    snippet = " ".join(html.unescape(_TAG.sub("", str(item.get("highlight_content") or ""))).split())
    return LiveHit(external_id=f"{kb_id}/{media_id}", title=title, text=snippet or title, knowledge_base=knowledge_base)


def _note_hit(item: Mapping[str, Any]) -> LiveHit | None:
    note_id = item.get("note_id") or item.get("doc_id")
    if not isinstance(note_id, str) or not note_id:
        return None
    title = str(item.get("title") or note_id)
    snippet = " ".join(_snippet(item.get("highlight_content") or item.get("summary")).split())
    return LiveHit(external_id=f"{NOTE_PREFIX}{note_id}", title=title, text=snippet or title, knowledge_base=NOTEBOOK)


def _snippet(value: object) -> str:
    return html.unescape(_TAG.sub("", str(value or "")))
