"""Citation numbers per conversation: the same document keeps its number across searches and reads."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

__all__ = ["CitationStore"]


class CitationStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def assign(self, conversation_id: str, document_ids: Sequence[str]) -> dict[str, int]:
        """Numbers for these documents: existing ones are reused, new ones continue the sequence
        in the order given. Two concurrent calls of one conversation are serialised by a lock."""
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext('citations:' || $1))", conversation_id)
            rows = await connection.fetch(
                "SELECT document_id, citation_index FROM conversation_citations WHERE conversation_id = $1",
                conversation_id,
            )
            numbers = {row["document_id"]: row["citation_index"] for row in rows}
            new = [document for document in dict.fromkeys(document_ids) if document not in numbers]
            next_number = max(numbers.values(), default=0) + 1
            for offset, document in enumerate(new):
                numbers[document] = next_number + offset
            if new:
                await connection.executemany(
                    "INSERT INTO conversation_citations (conversation_id, document_id, citation_index)"
                    " VALUES ($1, $2, $3)",
                    [(conversation_id, document, numbers[document]) for document in new],
                )
        return {document: numbers[document] for document in document_ids}
