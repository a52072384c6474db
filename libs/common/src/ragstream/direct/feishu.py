"""Feishu / Lark live search: unified search (``POST /open-apis/search/v2/doc_wiki/search``), the one
search API that takes the app's tenant token (the docs and wiki searches want a user's token)."""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from ragstream.connectors.feishu import FeishuClient, connection_client
from ragstream.direct.base import LiveHit
from ragstream.vendor_http import RetryPolicy

__all__ = ["MAX_QUERY_CHARS", "FeishuSearcher"]

#: A longer query fails validation (99992402), so it is cut to its first 30 characters.
MAX_QUERY_CHARS = 30
PAGE_SIZE = 20
# Highlighting wraps matches in tags (``<h>…</h>``); the hit's text is the plain summary.
_TAG = re.compile(r"<[^>]{0,200}>")


class FeishuSearcher:
    """The pages the app can see, or only the wiki pages of the configured ``space_ids``. ACL: none,
    as for the indexed pages (the app's grant is the connection's visibility)."""

    def __init__(self, client: FeishuClient, space_ids: list[str] | None, knowledge_base: str) -> None:
        self._client = client
        self._space_ids = space_ids
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
        platform: str = "feishu",
    ) -> FeishuSearcher:
        """The connector's validation of config and credentials (``ValueError`` naming fields)."""
        client, settings = connection_client(
            connection_id, config, credentials, platform=platform, timeout_s=timeout_s, retry=retry
        )
        return cls(client, settings.space_ids, name)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def search(self, query: str, wanted: int) -> list[LiveHit]:
        hits: list[LiveHit] = []
        page_token: str | None = None
        while len(hits) < wanted:
            data = await self._client.search(
                query[:MAX_QUERY_CHARS], page_size=PAGE_SIZE, page_token=page_token, space_ids=self._space_ids
            )
            units = data.get("res_units")
            for unit in units if isinstance(units, list) else []:
                if (hit := self._hit(unit)) is not None:
                    hits.append(hit)
            following = data.get("page_token")
            if not data.get("has_more") or not isinstance(following, str) or following == page_token:
                break
            page_token = following
        return hits[:wanted]

    def _hit(self, unit: object) -> LiveHit | None:
        if not isinstance(unit, dict):
            return None
        meta = unit.get("result_meta")
        token = meta.get("token") if isinstance(meta, dict) else None
        if not isinstance(token, str) or not token:
            return None
        title = _plain(unit.get("title_highlighted")) or token
        url = meta.get("url") if isinstance(meta, dict) else None
        return LiveHit(
            external_id=token,
            title=title,
            text=_plain(unit.get("summary_highlighted")) or title,
            knowledge_base=self._knowledge_base,
            url=url if isinstance(url, str) else None,
        )


def _plain(value: object) -> str:
    return " ".join(html.unescape(_TAG.sub("", value)).split()) if isinstance(value, str) else ""
