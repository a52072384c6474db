"""Connections as the control plane manages them: settings, encrypted credentials, the RAG switch.

Removing indexed content (a deleted connection, RAG turned off) also clears the tables that hold a
document's text or id without a foreign key to it: ``staged_documents`` (raw content),
``pending_batches`` (chunk text in flight) and, on delete, ``conversation_citations``. Chunks take
their vectors in every ``embeddings_<n>`` table with them (``ON DELETE CASCADE``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from pydantic import SecretStr

from ragstream.credentials import CredentialCipher, CredentialKeyMissing, CredentialsUnreadable
from ragstream.storage.spaces import drop_space_if_unused, pin_space
from ragstream.storage.sql import identifier

__all__ = ["Connection", "ConnectionStore", "PinnedModel", "RagSwitch", "new_connection_id"]

logger = logging.getLogger(__name__)


def new_connection_id() -> str:
    """Ids of API-made connections; folder syncs from the CLI keep their path-derived ``folder-…`` ids."""
    return f"conn-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class Connection:
    """A connection row without its credentials: only the names of the credential fields leave the store."""

    id: str
    platform: str
    name: str
    config: dict[str, Any]
    status: str
    skip_acl: bool
    rag_enabled: bool
    schedule_seconds: int
    has_credentials: bool
    credential_fields: tuple[str, ...]
    sync_error: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class RagSwitch:
    """What an update did to the RAG switch, so the caller knows whether to start a full sync."""

    connection: Connection
    rag_turned_on: bool


# sync_error: the latest failed sync's reason and a summary of the documents that did not index (0009).
@dataclass(frozen=True, slots=True)
class PinnedModel:
    """The embedding model a new connection is pinned to: its space's key and dimension, and the
    spec that builds its embedder in any process."""

    model_key: str
    dimension: int
    spec: dict[str, Any]


_COLUMNS = (
    "id, platform, name, config, status, skip_acl, rag_enabled, schedule_seconds, credentials,"
    " connection_sync_error(id) AS sync_error,"
    " created_at, updated_at"
)


class ConnectionStore:
    """Connection CRUD. ``skip_acl`` has no update path: it is fixed when the connection is created."""

    def __init__(self, pool: asyncpg.Pool, cipher: CredentialCipher) -> None:
        self._pool = pool
        self._cipher = cipher

    def _connection(self, row: asyncpg.Record) -> Connection:
        raw = row["config"]
        config = json.loads(raw) if isinstance(raw, str) else raw
        token = row["credentials"]
        return Connection(
            id=row["id"],
            platform=row["platform"],
            name=row["name"],
            config=dict(config or {}),
            status=row["status"],
            skip_acl=row["skip_acl"],
            rag_enabled=row["rag_enabled"],
            schedule_seconds=row["schedule_seconds"],
            has_credentials=token is not None,
            credential_fields=self._field_names(row["id"], token),
            sync_error=row["sync_error"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )

    def _field_names(self, connection_id: str, token: bytes | None) -> tuple[str, ...]:
        """Decrypting for the names keeps them out of the schema; the values are dropped at once. A token
        the keys cannot read (a key removed too early) shows no names rather than failing every listing."""
        if token is None:
            return ()
        try:
            return tuple(sorted(self._cipher.decrypt(bytes(token))))
        except (CredentialKeyMissing, CredentialsUnreadable):
            logger.warning("connection %s: its credentials cannot be decrypted with the configured keys", connection_id)
            return ()

    def _token(self, credentials: Mapping[str, SecretStr] | None) -> bytes | None:
        return self._cipher.encrypt(credentials) if credentials else None

    async def create(
        self,
        platform: str,
        name: str,
        *,
        config: Mapping[str, Any] | None = None,
        credentials: Mapping[str, SecretStr] | None = None,
        rag_enabled: bool = True,
        schedule_seconds: int = 86_400,
        skip_acl: bool = False,
        connection_id: str | None = None,
        embedding: PinnedModel | None = None,
    ) -> Connection:
        """With ``embedding``, the connection is pinned to that model's space from the start (created if
        need be), in the same transaction: its first sync already embeds with it."""
        async with self._pool.acquire() as connection, connection.transaction():
            if embedding is not None:
                await pin_space(connection, embedding.model_key, embedding.dimension, embedding.spec)
            row = await connection.fetchrow(
                f"INSERT INTO connections (id, platform, name, config, credentials, rag_enabled, schedule_seconds,"
                f" skip_acl, embedding_model_key) VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9)"
                f" RETURNING {_COLUMNS}",
                connection_id or new_connection_id(),
                platform,
                name,
                json.dumps(dict(config or {})),
                self._token(credentials),
                rag_enabled,
                schedule_seconds,
                skip_acl,
                embedding.model_key if embedding is not None else None,
            )
        assert row is not None
        return self._connection(row)

    async def all(self) -> list[Connection]:
        rows = await self._pool.fetch(f"SELECT {_COLUMNS} FROM connections ORDER BY created_at, id")
        return [self._connection(row) for row in rows]

    async def get(self, connection_id: str) -> Connection | None:
        row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM connections WHERE id = $1", connection_id)
        return self._connection(row) if row is not None else None

    async def update(
        self,
        connection_id: str,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        credentials: Mapping[str, SecretStr] | None = None,
        rag_enabled: bool | None = None,
        schedule_seconds: int | None = None,
        status: str | None = None,
    ) -> RagSwitch | None:
        """Change what is given (``None`` keeps a value). ``config`` replaces the top-level keys it names;
        ``credentials`` replaces the whole object (``{}`` removes it). ``None`` for an unknown id.

        Turning RAG off removes the indexed content in the same transaction; turning it on leaves the
        connection without any committed document, so its next sync indexes everything again."""
        async with self._pool.acquire() as connection, connection.transaction():
            before = await connection.fetchval(
                "SELECT rag_enabled FROM connections WHERE id = $1 FOR UPDATE", connection_id
            )
            if before is None:
                return None
            row = await connection.fetchrow(
                "UPDATE connections SET name = coalesce($2, name),"
                " config = CASE WHEN $3::jsonb IS NULL THEN config ELSE config || $3::jsonb END,"
                " credentials = CASE WHEN $4 THEN $5 ELSE credentials END,"
                " rag_enabled = coalesce($6, rag_enabled), schedule_seconds = coalesce($7, schedule_seconds),"
                f" status = coalesce($8, status), updated_at = now() WHERE id = $1 RETURNING {_COLUMNS}",
                connection_id,
                name,
                json.dumps(dict(config)) if config is not None else None,
                credentials is not None,
                self._token(credentials),
                rag_enabled,
                schedule_seconds,
                status,
            )
            assert row is not None
            if before and rag_enabled is False:
                await self._remove_indexed(connection, connection_id)
        return RagSwitch(self._connection(row), rag_turned_on=not before and rag_enabled is True)

    @staticmethod
    async def _remove_indexed(connection: asyncpg.Connection, connection_id: str) -> None:
        """Tombstone every document: no text, title, source or metadata stays, and a fresh version from
        the shared sequence outranks any change of the old content still in flight, which the indexer
        then drops as stale. Tombstones are not "committed", so the next sync fetches everything."""
        ids = await connection.fetchval(
            "WITH gone AS (UPDATE documents SET status = 'deleted', version = nextval('document_versions'),"
            " title = '', source = '', content_hash = '', source_version = NULL, url = NULL, metadata = '{}',"
            " chunk_count = 0, indexed_at = now() WHERE connection_id = $1 RETURNING id)"
            " SELECT coalesce(array_agg(id), '{}') FROM gone",
            connection_id,
        )
        await connection.execute("DELETE FROM chunks WHERE document_id = ANY($1::text[])", ids)
        await connection.execute("DELETE FROM document_failures WHERE connection_id = $1", connection_id)
        for table in ("staged_documents", "pending_batches"):
            await connection.execute(f"DELETE FROM {identifier(table)} WHERE document_id = ANY($1::text[])", ids)
        # Staged by a sync that never indexed it; and the cursors, so turning RAG on walks backward again.
        await connection.execute("DELETE FROM staged_documents WHERE connection_id = $1", connection_id)
        await connection.execute("DELETE FROM sync_cursors WHERE connection_id = $1", connection_id)

    async def delete(self, connection_id: str) -> bool:
        """Remove the connection and everything it indexed; False for an unknown id."""
        async with self._pool.acquire() as connection, connection.transaction():
            ids = await connection.fetchval(
                "SELECT coalesce(array_agg(id), '{}') FROM (SELECT id FROM documents WHERE connection_id = $1"
                " UNION SELECT document_id FROM document_failures WHERE connection_id = $1) AS known",
                connection_id,
            )
            for table in ("staged_documents", "pending_batches", "conversation_citations"):
                await connection.execute(f"DELETE FROM {identifier(table)} WHERE document_id = ANY($1::text[])", ids)
            await connection.execute("DELETE FROM staged_documents WHERE connection_id = $1", connection_id)
            # Cascades: documents -> chunks -> embeddings_<n>, document_failures, runs, sync_cursors.
            deleted = await connection.fetchrow(
                "DELETE FROM connections WHERE id = $1 RETURNING id, embedding_model_key", connection_id
            )
            if deleted is not None and deleted["embedding_model_key"] is not None:
                # The last connection pinned to a model takes its (now empty) table with it.
                await drop_space_if_unused(connection, deleted["embedding_model_key"])
        return deleted is not None

    async def credentials(self, connection_id: str) -> dict[str, SecretStr] | None:
        """Decrypted credentials, for the connector that calls the platform; never for an API response."""
        token = await self._pool.fetchval("SELECT credentials FROM connections WHERE id = $1", connection_id)
        return self._cipher.decrypt(bytes(token)) if token is not None else None

    async def rotate_credentials(self) -> int:
        """Re-encrypt every stored token with the primary key, in one transaction; returns how many.

        Afterwards the old keys can be removed from ``RAGSTREAM_CREDENTIAL_KEYS``."""
        async with self._pool.acquire() as connection, connection.transaction():
            rows = await connection.fetch(
                "SELECT id, credentials FROM connections WHERE credentials IS NOT NULL FOR UPDATE"
            )
            await connection.executemany(
                "UPDATE connections SET credentials = $2 WHERE id = $1",
                [(row["id"], self._cipher.rotate(bytes(row["credentials"]))) for row in rows],
            )
        return len(rows)
