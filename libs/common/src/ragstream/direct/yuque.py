"""Yuque live search: ``GET /api/v2/search`` over docs, its summary as the hit's text."""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr, ValidationError

from ragstream.connectors.yuque import YuqueClient, YuqueConfig, acl_for
from ragstream.direct.base import LiveHit
from ragstream.vendor_http import RetryPolicy

__all__ = ["YuqueSearcher"]

#: Hits per search page: fixed by the platform.
PAGE_SIZE = 20
_TAG = re.compile(r"<[^>]{0,200}>")


class YuqueSearcher:
    """Within the configured repos (one search each, scoped ``group/book``), else everything the
    token can see. The ACL of a hit follows the connector's (``acl_for``)."""

    def __init__(self, client: YuqueClient, settings: YuqueConfig, knowledge_base: str) -> None:
        self._client = client
        self._settings = settings
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
    ) -> YuqueSearcher:
        token = credentials.get("token")
        if token is None or not token.get_secret_value():
            raise ValueError(f"yuque connection {connection_id} needs credentials token")
        try:
            settings = YuqueConfig.model_validate(config)
        except ValidationError:
            raise ValueError(f"yuque connection {connection_id}: invalid config (base_url, repos)") from None
        client = YuqueClient(token, base_url=settings.base_url, timeout_s=timeout_s, retry=retry)
        return cls(client, settings, name)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def search(self, query: str, wanted: int) -> list[LiveHit]:
        hits: list[LiveHit] = []
        scopes: list[str | None] = [*self._settings.repos] if self._settings.repos else [None]
        for scope in scopes:
            page = 1
            while len(hits) < wanted:
                found = await self._client.search(query, page=page, scope=scope)
                hits.extend(hit for item in found if (hit := self._hit(item)) is not None)
                if len(found) < PAGE_SIZE:
                    break
                page += 1
        return hits[:wanted]

    def _hit(self, item: Mapping[str, Any]) -> LiveHit | None:
        target = _object(item.get("target"))
        book = _object(target.get("book"))
        namespace = book.get("namespace")
        doc_id = item.get("id")
        if not isinstance(namespace, str) or doc_id is None:
            return None
        title = str(item.get("title") or target.get("title") or doc_id)
        summary = html.unescape(_TAG.sub("", str(item.get("summary") or "")))
        url = item.get("url")
        link = self._settings.base_url.rstrip("/") + url if isinstance(url, str) and url.startswith("/") else url
        return LiveHit(
            external_id=f"{namespace}/{doc_id}",
            title=_TAG.sub("", title),
            text=" ".join(summary.split()) or title,
            knowledge_base=str(book.get("name") or item.get("info") or self._knowledge_base),
            url=link if isinstance(link, str) else None,
            acl=acl_for(namespace, book.get("public"), target.get("public")),
        )


def _object(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
