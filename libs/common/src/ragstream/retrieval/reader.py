"""Reading a whole document after a search: its text within the call budget, under the citation
number it has (or gets) in the conversation."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from ragstream.core.search import Principal
from ragstream.retrieval.budget import MAX_CALL_CHARS, truncate_text
from ragstream.storage.citations import CitationStore
from ragstream.storage.documents_read import DocumentReadStore

__all__ = ["DocumentRead", "DocumentReader", "join_chunks"]

# Neighbouring chunks repeat up to the chunker's overlap; shorter matches are taken for chance.
_MIN_OVERLAP = 10
_MAX_OVERLAP = 4000


class DocumentRead(BaseModel):
    document_id: str
    citation_index: Annotated[
        int,
        Field(
            title="Citation number",
            description="The document's number in the conversation (kept from earlier searches and reads);"
            " 1 without a conversation.",
        ),
    ]
    connection_id: str
    platform: Annotated[str, Field(title="Platform of the connection")]
    knowledge_base: Annotated[str, Field(title="Knowledge base name")]
    title: str
    source: Annotated[str, Field(title="Source", description="Path relative to the folder root, or the URL.")]
    url: Annotated[str | None, Field(title="Link to the original")] = None
    metadata: Annotated[dict[str, Any], Field(title="Document metadata")] = {}
    text: Annotated[str, Field(title="Document text", description="Chunks in order, cut to the call budget.")]
    truncated: Annotated[bool, Field(title="Whether the text was cut to the budget")]


def join_chunks(texts: list[str], limit: int) -> tuple[str, bool]:
    """The chunks as one text, each overlap with the previous chunk dropped, cut at ``limit``
    characters (at a sentence end when possible). Returns the text and whether it was cut."""
    joined = ""
    for text in texts:
        if not joined:
            joined = text
        else:
            overlap = _overlap(joined, text)
            rest = text[overlap:].lstrip()
            if rest:
                # An overlap means the chunker cut inside a paragraph: continue it on the same line.
                joined += (" " if overlap else "\n\n") + rest
        if len(joined) > limit:
            return truncate_text(joined, limit), True
    return joined, False


def _overlap(previous: str, following: str) -> int:
    """Length of the longest prefix of ``following`` that ends ``previous``, if long enough to count."""
    for length in range(min(len(previous), len(following), _MAX_OVERLAP), _MIN_OVERLAP - 1, -1):
        if previous.endswith(following[:length]):
            return length
    return 0


class DocumentReader:
    def __init__(self, store: DocumentReadStore, citations: CitationStore) -> None:
        self._store = store
        self._citations = citations

    async def read(
        self,
        document_id: str,
        principal: Principal | None,
        *,
        conversation_id: str | None = None,
        max_chars: int = MAX_CALL_CHARS,
    ) -> DocumentRead | None:
        """``None`` alike for a document that does not exist and one the caller may not see; a
        number is assigned only to a document the caller could read, so numbering hints at nothing.
        ``max_chars`` is the caller's budget: the HTTP route caps it at the call budget, the knowledge
        tool's read asks for the whole document."""
        document = await self._store.read(document_id, principal)
        if document is None:
            return None
        number = 1
        if conversation_id:
            number = (await self._citations.assign(conversation_id, [document.document_id]))[document.document_id]
        text, truncated = join_chunks(document.texts, max_chars)
        return DocumentRead(
            document_id=document.document_id,
            citation_index=number,
            connection_id=document.connection_id,
            platform=document.platform,
            knowledge_base=document.knowledge_base,
            title=document.title,
            source=document.source,
            url=document.url,
            metadata=document.metadata,
            text=text,
            truncated=truncated,
        )
