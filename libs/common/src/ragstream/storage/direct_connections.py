"""The connections searched live: RAG off, active, on a platform with a live search, in scope."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from pydantic import SecretStr

from ragstream.core.search import SearchFilters
from ragstream.credentials import CredentialCipher, CredentialKeyMissing, CredentialsUnreadable

__all__ = ["DirectConnection", "DirectConnectionStore", "readable_connection"]


@dataclass(frozen=True, slots=True)
class DirectConnection:
    """A connection to search live. ``credentials`` are decrypted (``SecretStr`` values); when they
    cannot be, ``unreadable`` says why and they are empty. ``updated_at`` tells a cached client of an
    older version of the row."""

    id: str
    platform: str
    name: str
    skip_acl: bool
    updated_at: datetime
    config: dict[str, Any] = field(default_factory=dict)
    credentials: dict[str, SecretStr] = field(default_factory=dict)
    unreadable: str | None = None


class DirectConnectionStore:
    def __init__(self, pool: asyncpg.Pool, cipher: CredentialCipher) -> None:
        self._pool = pool
        self._cipher = cipher

    async def in_scope(self, filters: SearchFilters, platforms: Collection[str]) -> list[DirectConnection]:
        """The active RAG-off connections of ``platforms`` that the filters' connection and platform
        lists let through (the other filters apply to each hit)."""
        rows = await self._pool.fetch(
            "SELECT id, platform, name, config, credentials, skip_acl, updated_at FROM connections"
            " WHERE NOT rag_enabled AND status = 'active' AND platform = ANY($1::text[])"
            " AND ($2::text[] IS NULL OR id = ANY($2::text[]))"
            " AND ($3::text[] IS NULL OR platform = ANY($3::text[]))"
            " ORDER BY id",
            sorted(platforms),
            filters.connection_ids,
            filters.platforms,
        )
        return [self._connection(row) for row in rows]

    def _connection(self, row: asyncpg.Record) -> DirectConnection:
        config, credentials, unreadable = readable_connection(row, self._cipher)
        return DirectConnection(
            id=row["id"],
            platform=row["platform"],
            name=row["name"],
            skip_acl=row["skip_acl"],
            updated_at=row["updated_at"],
            config=config,
            credentials=credentials,
            unreadable=unreadable,
        )


def readable_connection(
    row: asyncpg.Record, cipher: CredentialCipher
) -> tuple[dict[str, Any], dict[str, SecretStr], str | None]:
    """A connection row's config and decrypted credentials, and why the credentials cannot be read
    (None when they can): a key rotated away leaves the connection listed, with that reason."""
    raw = row["config"]
    config = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    credentials: dict[str, SecretStr] = {}
    unreadable = None
    if row["credentials"] is not None:
        try:
            credentials = cipher.decrypt(bytes(row["credentials"]))
        except (CredentialKeyMissing, CredentialsUnreadable):
            unreadable = "its credentials cannot be decrypted with the configured keys"
    return config, credentials, unreadable
