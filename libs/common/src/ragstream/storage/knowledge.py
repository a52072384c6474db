"""What the knowledge tool reads besides search: a connection with its credentials, the origin of an
indexed document, and each conversation's run of searches without a result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import asyncpg
from pydantic import SecretStr

from ragstream.credentials import CredentialCipher
from ragstream.storage.direct_connections import readable_connection

__all__ = ["IndexedOrigin", "KnowledgeConnection", "KnowledgeStore"]


@dataclass(frozen=True, slots=True)
class KnowledgeConnection:
    """An active connection. ``credentials`` are decrypted; when they cannot be, ``unreadable`` says
    why and they are empty."""

    id: str
    platform: str
    name: str
    rag_enabled: bool
    skip_acl: bool
    config: dict[str, Any] = field(default_factory=dict)
    credentials: dict[str, SecretStr] = field(default_factory=dict)
    unreadable: str | None = None


@dataclass(frozen=True, slots=True)
class IndexedOrigin:
    """Where an indexed document comes from: its connection and its id on the platform."""

    document_id: str
    connection_id: str
    external_id: str


_COLUMNS = "id, platform, name, rag_enabled, skip_acl, config, credentials"


class KnowledgeStore:
    def __init__(self, pool: asyncpg.Pool, cipher: CredentialCipher) -> None:
        self._pool = pool
        self._cipher = cipher

    async def connections(
        self, *, platform: str | None = None, connection_id: str | None = None
    ) -> list[KnowledgeConnection]:
        """The active connections of ``platform`` and/or with ``connection_id`` (each, when given)."""
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM connections WHERE status = 'active'"
            " AND ($1::text IS NULL OR platform = $1) AND ($2::text IS NULL OR id = $2) ORDER BY id",
            platform,
            connection_id,
        )
        return [self._connection(row) for row in rows]

    async def indexed(self, document_id: str) -> IndexedOrigin | None:
        """The origin of an indexed (not deleted) document of an active connection."""
        row = await self._pool.fetchrow(
            "SELECT d.id, d.connection_id, d.external_id FROM documents d JOIN connections k ON k.id = d.connection_id"
            " WHERE d.id = $1 AND d.status = 'indexed' AND k.status = 'active'",
            document_id,
        )
        if row is None:
            return None
        return IndexedOrigin(row["id"], row["connection_id"], row["external_id"])

    async def record_search(self, conversation_id: str, *, found: bool) -> int:
        """Count a search of the conversation; the number of searches in a row, this one included,
        that found nothing (0 after a search that found something)."""
        count = await self._pool.fetchval(
            "INSERT INTO conversation_search_streaks (conversation_id, empty_searches) VALUES ($1, $2)"
            " ON CONFLICT (conversation_id) DO UPDATE SET updated_at = now(), empty_searches ="
            " CASE WHEN $2 = 0 THEN 0 ELSE conversation_search_streaks.empty_searches + 1 END"
            " RETURNING empty_searches",
            conversation_id,
            0 if found else 1,
        )
        return int(count)

    def _connection(self, row: asyncpg.Record) -> KnowledgeConnection:
        config, credentials, unreadable = readable_connection(row, self._cipher)
        return KnowledgeConnection(
            id=row["id"],
            platform=row["platform"],
            name=row["name"],
            rag_enabled=row["rag_enabled"],
            skip_acl=row["skip_acl"],
            config=config,
            credentials=credentials,
            unreadable=unreadable,
        )
