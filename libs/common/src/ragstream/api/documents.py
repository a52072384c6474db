"""``GET /v1/documents/{id}``: a document's text and source card, under the rules of search."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request

from ragstream.api.auth import check_principal, search_route
from ragstream.core.storable import Storable, StorableStr
from ragstream.retrieval import Principal
from ragstream.retrieval.budget import MAX_CALL_CHARS
from ragstream.retrieval.reader import DocumentRead, DocumentReader

__all__ = ["documents_router"]


def documents_router(reader: Callable[[], DocumentReader | None]) -> APIRouter:
    """``reader`` is a getter because an app may start before the store is open (503 until then)."""
    router = APIRouter(tags=["documents"])

    @router.get(
        "/v1/documents/{document_id}",
        response_model=DocumentRead,
        responses={404: {"description": "No such document, or not one the caller may see (the same answer)"}},
    )
    @search_route
    async def read_document(
        http: Request,
        document_id: StorableStr,
        conversation_id: Annotated[
            str | None,
            Query(max_length=200, description="Keeps the citation number of earlier searches."),
            Storable,
        ] = None,
        user: Annotated[
            str | None, Query(min_length=1, description="Caller; without one, only unrestricted chunks."), Storable
        ] = None,
        groups: Annotated[list[StorableStr], Query(description="Caller's groups: repeated or comma-separated.")] = [],  # noqa: B006
        max_chars: Annotated[int, Query(ge=1, le=MAX_CALL_CHARS, description="Text budget.")] = MAX_CALL_CHARS,
    ) -> DocumentRead:
        """The document's text (chunks in order, cut to the budget) and its source-card fields,
        under the same scope and permission rules as search."""
        check_principal(http, user is not None)
        current = reader()
        if current is None:
            raise HTTPException(status_code=503, detail="the index is still starting")
        names = [name for value in groups for name in value.split(",") if name]
        if names and user is None:
            raise HTTPException(status_code=422, detail="groups need a user")
        principal = Principal(user=user, groups=names) if user is not None else None
        document = await current.read(document_id, principal, conversation_id=conversation_id, max_chars=max_chars)
        if document is None:
            raise HTTPException(status_code=404, detail="document not found")
        return document

    return router
