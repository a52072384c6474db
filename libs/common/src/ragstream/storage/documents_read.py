"""Reading one document back for a caller, under the same scope and permission rules as search."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from ragstream.core.search import Principal, SearchFilters
from ragstream.storage.scope import Scope

__all__ = ["DocumentChunks", "DocumentReadStore"]


@dataclass(frozen=True, slots=True)
class DocumentChunks:
    """A document's source-card fields and the texts of the chunks the caller may see, in order."""

    document_id: str
    connection_id: str
    platform: str
    knowledge_base: str
    title: str
    source: str
    url: str | None
    metadata: dict[str, Any]
    texts: list[str]


class DocumentReadStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def read(self, document_id: str, principal: Principal | None) -> DocumentChunks | None:
        """``None`` alike for an unknown, deleted, out-of-scope or forbidden document.

        The rows come through ``Scope``, the clause both search legs use, so a read shows exactly
        what a search could have shown: an indexed document of an active connection, and only the
        chunks whose ACL admits the caller (a document none of whose chunks do does not exist).
        """
        scope = Scope.build(SearchFilters(), principal, first_param=2)
        rows = await self._pool.fetch(
            "SELECT d.id, d.connection_id, k.platform, d.knowledge_base, d.title, d.source, d.url, d.metadata,"
            f" c.text FROM chunks c {scope.joins} WHERE d.id = $1 AND {scope.sql} ORDER BY c.ordinal",
            document_id,
            *scope.params,
        )
        if not rows:
            return None
        first = rows[0]
        metadata = first["metadata"]
        return DocumentChunks(
            document_id=first["id"],
            connection_id=first["connection_id"],
            platform=first["platform"],
            knowledge_base=first["knowledge_base"],
            title=first["title"],
            source=first["source"],
            url=first["url"],
            metadata=json.loads(metadata) if isinstance(metadata, str) else dict(metadata),
            texts=[row["text"] for row in rows],
        )
