"""The committed state of every document, and the one transaction that replaces a document's chunks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from ragstream.core.errors import DocumentError
from ragstream.core.vectors import Vectors
from ragstream.messages import ChunkPayload, ChunksEmbedded, DocumentDeleted, DocumentHeader, IndexOutcome
from ragstream.segmentation import segment
from ragstream.storage.cursors import SyncCursorStore
from ragstream.storage.spaces import lock_space
from ragstream.storage.sql import identifier

__all__ = [
    "CommittedDocument",
    "DocumentStore",
    "Failure",
    "StaleChunkingError",
    "chunk_id",
    "document_id",
    "write_chunks",
]


def document_id(connection_id: str, external_id: str) -> str:
    """Stable across syncs and processes, so every stage derives the same key for the same file."""
    return hashlib.sha256(f"{connection_id}\0{external_id}".encode()).hexdigest()[:32]


def chunk_id(document_id: str, version: int, ordinal: int, index_version: int = 0) -> str:
    """Index version 0 keeps the ids chunks had before index versions existed (migration 0010)."""
    key = f"{document_id}\0{version}\0{ordinal}" + (f"\0{index_version}" if index_version else "")
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class StaleChunkingError(DocumentError):
    """Chunks made with the chunker of an index version a re-chunk has replaced (chunked before the
    switch, committed after it): the document must be chunked again with the connection's current
    config. Retryable: the embedded pipeline does it at once, a replay or the next sync otherwise."""

    retryable = True

    def __init__(self, document_id: str, chunked_for: int, active: int) -> None:
        super().__init__(
            f"document {document_id} was chunked for index version {chunked_for}, the connection's is now"
            f" {active}; chunk it again"
        )
        self.document_id = document_id


async def write_chunks(
    connection: asyncpg.Connection,
    document_id: str,
    title: str,
    chunks: Sequence[ChunkPayload],
    ids: Sequence[str],
    acl: Sequence[str] | None,
    index_version: int,
    table: str,
    vectors: Vectors,
) -> None:
    """Insert a document's chunks of one index version with their keyword fields and vectors; the
    caller's transaction holds the embedding space (``lock_space``) and the document's lock."""
    await connection.execute(
        "INSERT INTO chunks (id, document_id, ordinal, heading, text, search_vector, lexeme_count, acl, index_version)"
        " SELECT id, $1, ordinal, heading, text, sv,"
        " (SELECT coalesce(sum(cardinality(lexeme.positions)), 0) FROM unnest(sv) AS lexeme), $8::text[], $9"
        " FROM (SELECT id, ordinal, heading, text,"
        "  setweight(to_tsvector('english', head), 'A') || to_tsvector('english', body) AS sv"
        "  FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::text[], $7::text[])"
        "  AS t(id, ordinal, heading, text, head, body)) AS prepared",
        document_id,
        list(ids),
        [chunk.ordinal for chunk in chunks],
        [chunk.heading for chunk in chunks],
        [chunk.text for chunk in chunks],
        [segment(f"{title} {chunk.heading}") for chunk in chunks],
        [segment(chunk.text) for chunk in chunks],
        list(acl) if acl is not None else None,
        index_version,
    )
    await connection.copy_records_to_table(
        table, records=list(zip(ids, list(vectors), strict=True)), columns=["chunk_id", "embedding"]
    )


@dataclass(frozen=True, slots=True)
class CommittedDocument:
    document_id: str
    external_id: str
    source: str
    content_hash: str
    source_version: str | None
    acl: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    document_id: str
    source: str
    version: int
    step: str
    code: str
    message: str
    retryable: bool
    retry_count: int


# Failures still open (not resolved by a commit of their version or a newer one): the view of
# migration 0009, which a connection's sync_error summary reads too.
_OPEN_FAILURES = "open_document_failures f"


class DocumentStore:
    """Everything the pipeline stages read and write in PostgreSQL, behind intention-named methods."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        # Where each stage's walk of a connection got to, so an interrupted sync resumes.
        self.cursors = SyncCursorStore(pool)

    async def ensure_connection(
        self, connection_id: str, platform: str, name: str, config: Mapping[str, Any] | None = None
    ) -> None:
        """Register the connection. ``config`` replaces the top-level keys it names in the stored config
        (``{"chunking": {...}}``); without it the stored config is kept, so a later sync without options
        goes on with what an earlier one chose. A new config applies to documents chunked from now
        on: unchanged documents keep their chunks until they change (this does not re-chunk them; a
        re-chunk run does, ``ragstream.rechunk``)."""
        if config is None:
            await self._pool.execute(
                "INSERT INTO connections (id, platform, name) VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING",
                connection_id,
                platform,
                name,
            )
            return
        await self._pool.execute(
            "INSERT INTO connections (id, platform, name, config) VALUES ($1, $2, $3, $4::jsonb) "
            "ON CONFLICT (id) DO UPDATE SET config = connections.config || EXCLUDED.config",
            connection_id,
            platform,
            name,
            json.dumps(dict(config)),
        )

    async def connection_config(self, connection_id: str) -> dict[str, Any]:
        """The stored config of a connection (``{}`` when unknown or unset).

        Not cached: another process (the CLI, the fetcher) may change it, and one primary-key read
        per document is nothing next to parsing and embedding it."""
        raw = await self._pool.fetchval("SELECT config FROM connections WHERE id = $1", connection_id)
        config = json.loads(raw) if isinstance(raw, str) else raw
        return dict(config) if isinstance(config, dict) else {}

    async def chunking_of(self, connection_id: str) -> tuple[Any, int]:
        """The connection's stored chunking config (``None``: the server's) and its active index
        version, read together: a re-chunk switch changes both in one transaction."""
        row = await self._pool.fetchrow(
            "SELECT config -> 'chunking' AS chunking, index_version FROM connections WHERE id = $1", connection_id
        )
        if row is None:
            return None, 0
        chunking = json.loads(row["chunking"]) if isinstance(row["chunking"], str) else row["chunking"]
        return chunking, int(row["index_version"])

    async def committed(self, connection_id: str) -> dict[str, CommittedDocument]:
        """Indexed documents of a connection by external id: what a sync compares its listing with."""
        rows = await self._pool.fetch(
            "SELECT d.id, d.external_id, d.source, d.content_hash, d.source_version,"
            " (SELECT c.acl FROM chunks c WHERE c.document_id = d.id ORDER BY c.ordinal LIMIT 1) AS acl"
            " FROM documents d WHERE d.connection_id = $1 AND d.status = 'indexed'",
            connection_id,
        )
        return {
            row["external_id"]: CommittedDocument(
                row["id"], row["external_id"], row["source"], row["content_hash"], row["source_version"], row["acl"]
            )
            for row in rows
        }

    async def update_acl(self, document_id: str, acl: Sequence[str] | None) -> None:
        """Give every chunk of the committed document this ACL; vectors and text stay as they are."""
        await self._pool.execute(
            "UPDATE chunks SET acl = $2::text[] WHERE document_id = $1",
            document_id,
            list(acl) if acl is not None else None,
        )

    async def remember_source_version(self, document_id: str, source_version: str | None) -> None:
        await self._pool.execute("UPDATE documents SET source_version = $2 WHERE id = $1", document_id, source_version)

    async def next_version(self) -> int:
        return int(await self._pool.fetchval("SELECT nextval('document_versions')"))

    async def stage(self, header: DocumentHeader, content: bytes) -> None:
        """Store raw content durably before announcing it, under the header's version (from
        ``next_version``); the header stays with it so a resumed sync can announce it again."""
        await self._pool.execute(
            "INSERT INTO staged_documents (version, document_id, connection_id, header, content)"
            " VALUES ($1, $2, $3, $4::jsonb, $5)",
            header.version,
            header.document_id,
            header.connection_id,
            header.model_dump_json(),
            content,
        )

    async def pending_staged(self, connection_id: str) -> dict[str, DocumentHeader]:
        """The newest staged version of each document that nothing newer has superseded (no commit,
        no tombstone), by external id: what an interrupted sync downloaded but never indexed.

        A version that failed for good (binary, empty, rejected: a non-retryable failure of it or of
        a newer version) is not pending: announcing it again could only fail again, growing its
        retry count and dead-lettering it once more. Its item is examined as in any walk."""
        rows = await self._pool.fetch(
            "SELECT p.header FROM (SELECT DISTINCT ON (s.document_id) s.document_id, s.version,"
            " s.header::text AS header FROM staged_documents s LEFT JOIN documents d ON d.id = s.document_id"
            " WHERE s.connection_id = $1 AND s.header IS NOT NULL AND (d.version IS NULL OR d.version < s.version)"
            " ORDER BY s.document_id, s.version DESC) p"
            " WHERE NOT EXISTS (SELECT 1 FROM document_failures f"
            "  WHERE f.document_id = p.document_id AND f.version >= p.version AND NOT f.retryable)",
            connection_id,
        )
        headers = [DocumentHeader.model_validate_json(row["header"]) for row in rows]
        return {header.external_id: header for header in headers}

    async def load_staged(self, version: int) -> bytes | None:
        content = await self._pool.fetchval("SELECT content FROM staged_documents WHERE version = $1", version)
        return bytes(content) if content is not None else None

    async def add_pending_batch(self, message: ChunksEmbedded) -> list[ChunksEmbedded] | None:
        """Park one batch of a multi-batch document; return all batches once the last has arrived.

        A batch arriving again replaces the parked one: a replay after a re-index switched models
        mid-document re-embeds every batch with the new model, and none of the old may stay. Only
        batches of the arriving one's index version count, so a document chunked again after a
        re-chunk switch never completes with batches of the old chunking.
        A batch of a version already committed or superseded is not parked: it is a redelivery after
        the commit (Kafka delivers at least once) or a straggler of an older version, and it could
        never complete, so it would stay in ``pending_batches`` for good.
        """
        header = message.header
        async with self._pool.acquire() as connection, connection.transaction():
            # Serialises with commit_document and delete_document of the same document (same lock).
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", header.document_id)
            committed = await connection.fetchval("SELECT version FROM documents WHERE id = $1", header.document_id)
            if committed is not None and committed >= header.version:
                return None
            await connection.execute(
                "INSERT INTO pending_batches (document_id, version, batch_index, batch_count, payload) "
                "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (document_id, version, batch_index)"
                " DO UPDATE SET batch_count = EXCLUDED.batch_count, payload = EXCLUDED.payload",
                header.document_id,
                header.version,
                message.batch_index,
                message.batch_count,
                message.model_dump_json().encode(),
            )
            rows = await connection.fetch(
                "SELECT payload FROM pending_batches WHERE document_id = $1 AND version = $2 ORDER BY batch_index",
                header.document_id,
                header.version,
            )
        if len(rows) < message.batch_count:
            return None
        batches = [ChunksEmbedded.model_validate_json(row["payload"]) for row in rows]
        # Batches parked by an earlier chunking of this version, for an index version a re-chunk has
        # since replaced: the new chunking's batches replace them as they arrive, and do not mix.
        batches = [
            batch
            for batch in batches
            if batch.index_version == message.index_version and batch.batch_count == message.batch_count
        ]
        return batches if len(batches) == message.batch_count else None

    async def commit_document(
        self,
        header: DocumentHeader,
        chunks: Sequence[ChunkPayload],
        vectors: Vectors,
        model_key: str,
        index_version: int = 0,
    ) -> IndexOutcome:
        """Upsert the document, replace its chunks and vectors, all in one transaction.

        Nothing changes when the committed version is already as new: redelivered or reordered
        messages are harmless, and the previous version stays searchable until this one commits.
        Vectors of a model that is not the connection's (``lock_space``) raise ``RetiredSpaceError``
        (retryable); chunks made for an index version that is not the connection's active one raise
        ``StaleChunkingError``.
        """
        ids = [chunk_id(header.document_id, header.version, chunk.ordinal, index_version) for chunk in chunks]
        async with self._pool.acquire() as connection, connection.transaction():
            # First, so that a re-index switch waits for this commit or this commit for the switch.
            table = await lock_space(connection, model_key, int(vectors.shape[1]), header.connection_id)
            # lock_space holds this row FOR KEY SHARE already: a re-chunk switch (FOR UPDATE on this row)
            # waits for this commit, or this commit reads the index version the switch made active.
            active = await connection.fetchval(
                "SELECT index_version FROM connections WHERE id = $1 FOR KEY SHARE", header.connection_id
            )
            if active is not None and active != index_version:
                committed = await connection.fetchval("SELECT version FROM documents WHERE id = $1", header.document_id)
                if committed is not None and committed >= header.version:
                    return IndexOutcome.STALE
                raise StaleChunkingError(header.document_id, index_version, active)
            # So a batch is never parked for a version this transaction is about to supersede.
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", header.document_id)
            updated = await connection.fetchval(
                "INSERT INTO documents (id, connection_id, external_id, title, source, media_type, content_hash,"
                " source_version, version, status, chunk_count, knowledge_base, url, metadata, indexed_at, retry_count)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'indexed', $10, $11, $12, $13, now(),"
                # The retries this version took: its failure row, if any, counted them, including the
                # one a retrying row announced; otherwise this commit is itself a retry (a replay).
                "  coalesce((SELECT f.retry_count + CASE WHEN f.retrying THEN 0 ELSE 1 END FROM document_failures f"
                "   WHERE f.document_id = $1 AND f.version = $9), 0))"
                " ON CONFLICT (id) DO UPDATE SET title = EXCLUDED.title, source = EXCLUDED.source,"
                " media_type = EXCLUDED.media_type, content_hash = EXCLUDED.content_hash,"
                " source_version = EXCLUDED.source_version, version = EXCLUDED.version, status = 'indexed',"
                " chunk_count = EXCLUDED.chunk_count, knowledge_base = EXCLUDED.knowledge_base,"
                " url = EXCLUDED.url, metadata = EXCLUDED.metadata, indexed_at = now(),"
                " retry_count = EXCLUDED.retry_count"
                " WHERE documents.version < EXCLUDED.version RETURNING id",
                header.document_id,
                header.connection_id,
                header.external_id,
                header.title,
                header.source,
                header.media_type,
                header.content_hash,
                header.source_version,
                header.version,
                len(chunks),
                header.knowledge_base,
                header.url,
                json.dumps(header.metadata),
            )
            if updated is None:
                return IndexOutcome.STALE
            # Every index version: a re-chunk run rebuilds this document again from the new content.
            await connection.execute("DELETE FROM chunks WHERE document_id = $1", header.document_id)
            await write_chunks(
                connection, header.document_id, header.title, chunks, ids, header.acl, index_version, table, vectors
            )
            await self._forget_older(connection, header.document_id, header.version)
        return IndexOutcome.INDEXED

    async def delete_document(self, message: DocumentDeleted) -> IndexOutcome:
        """Replace the document by a tombstone that outranks every older change of it."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", message.document_id)
            updated = await connection.fetchval(
                "INSERT INTO documents (id, connection_id, external_id, title, source, media_type, content_hash,"
                " version, status) VALUES ($1, $2, $3, '', $4, '', '', $5, 'deleted')"
                " ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, status = 'deleted', chunk_count = 0,"
                " indexed_at = now() WHERE documents.version < EXCLUDED.version RETURNING id",
                message.document_id,
                message.connection_id,
                message.external_id,
                message.source,
                message.version,
            )
            if updated is None:
                return IndexOutcome.STALE
            await connection.execute("DELETE FROM chunks WHERE document_id = $1", message.document_id)
            await self._forget_older(connection, message.document_id, message.version, keep_staged=False)
        return IndexOutcome.DELETED

    @staticmethod
    async def _forget_older(
        connection: asyncpg.Connection, document_id: str, version: int, *, keep_staged: bool = True
    ) -> None:
        """Drop what the committed version supersedes. The committed version's own staged content is
        kept (unless deleted) so a replay of ``doc.changed`` can rebuild an index from it."""
        for table in ("pending_batches", "document_failures"):
            await connection.execute(
                f"DELETE FROM {identifier(table)} WHERE document_id = $1 AND version <= $2", document_id, version
            )
        await connection.execute(
            f"DELETE FROM staged_documents WHERE document_id = $1 AND version {'<' if keep_staged else '<='} $2",
            document_id,
            version,
        )

    async def is_superseded(self, document_id: str, version: int) -> bool:
        """True when this version or a newer one is committed: work on it would be thrown away."""
        committed = await self._pool.fetchval("SELECT version FROM documents WHERE id = $1", document_id)
        return committed is not None and committed >= version

    async def record_failure(
        self, header: DocumentHeader, *, step: str, code: str, message: str, retryable: bool, retrying: bool = False
    ) -> Failure:
        """Record why a version did not index. ``retrying``: a stage is about to try it again (not
        given up on yet). The retry count is the retries of this version made so far, the one under
        way included: a retrying row counts the retry it announces, and a failure after a row that
        was not retrying (a replay) counts the replay."""
        row = await self._pool.fetchrow(
            "INSERT INTO document_failures"
            " (document_id, connection_id, source, version, step, code, message, retryable, header, retrying,"
            " retry_count) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, CASE WHEN $10 THEN 1 ELSE 0 END)"
            " ON CONFLICT (document_id) DO UPDATE SET source = EXCLUDED.source, step = EXCLUDED.step,"
            " retrying = EXCLUDED.retrying,"
            " code = EXCLUDED.code, message = EXCLUDED.message, retryable = EXCLUDED.retryable, failed_at = now(),"
            " header = EXCLUDED.header,"
            " retry_count = CASE WHEN document_failures.version = EXCLUDED.version"
            "   THEN document_failures.retry_count + CASE WHEN document_failures.retrying THEN 0 ELSE 1 END"
            "   ELSE 0 END + EXCLUDED.retry_count, version = EXCLUDED.version"
            " RETURNING retry_count",
            header.document_id,
            header.connection_id,
            header.source,
            header.version,
            step,
            code,
            message[:2000],
            retryable,
            header.model_dump_json(),
            retrying,
        )
        assert row is not None
        return Failure(
            header.document_id, header.source, header.version, step, code, message, retryable, row["retry_count"]
        )

    async def forget_failures_except(self, connection_id: str, listed: Sequence[str]) -> None:
        """Drop the failures of the connection's documents that are no longer listed at the source."""
        await self._pool.execute(
            "DELETE FROM document_failures WHERE connection_id = $1 AND NOT (document_id = ANY($2::text[]))",
            connection_id,
            list(listed),
        )

    async def failures(self, connection_id: str | None) -> list[Failure]:
        """The documents whose latest version did not index, of one connection (or all: None)."""
        rows = await self._pool.fetch(
            f"SELECT f.* FROM {_OPEN_FAILURES} WHERE ($1::text IS NULL OR f.connection_id = $1) ORDER BY f.source",
            connection_id,
        )
        return [
            Failure(
                r["document_id"],
                r["source"],
                r["version"],
                r["step"],
                r["code"],
                r["message"],
                r["retryable"],
                r["retry_count"],
            )
            for r in rows
        ]

    async def replayable(self, connection_id: str | None) -> tuple[list[DocumentHeader], int]:
        """Headers of the failed versions a replay can re-drive, and how many failures need a re-sync.

        A failure is replayable when it is not superseded by a commit and its version's content is
        staged: it failed after the fetch (chunk, embed or index). A fetch failure has no content to
        replay; the next sync fetches it again.
        """
        rows = await self._pool.fetch(
            "SELECT f.header::text AS header,"
            " EXISTS (SELECT 1 FROM staged_documents s WHERE s.version = f.version) AS staged"
            f" FROM {_OPEN_FAILURES} WHERE ($1::text IS NULL OR f.connection_id = $1) ORDER BY f.version",
            connection_id,
        )
        headers = [DocumentHeader.model_validate_json(row["header"]) for row in rows if row["staged"] and row["header"]]
        return headers, len(rows) - len(headers)

    async def is_replayable(self, header: DocumentHeader) -> bool:
        """True while this version is still the document's failing one and its content is staged."""
        return bool(
            await self._pool.fetchval(
                f"SELECT EXISTS (SELECT 1 FROM {_OPEN_FAILURES} WHERE f.document_id = $1 AND f.version = $2"
                " AND EXISTS (SELECT 1 FROM staged_documents s WHERE s.version = f.version))",
                header.document_id,
                header.version,
            )
        )
