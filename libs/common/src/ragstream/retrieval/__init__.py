"""Hybrid retrieval with citations: the request and response models and the retriever."""

from ragstream.core.search import (
    ChatTurn,
    Principal,
    SearchFilters,
    SearchRequest,
    SearchResponse,
    SearchResult,
)
from ragstream.retrieval.budget import truncate_text
from ragstream.retrieval.retriever import HybridRetriever, RetrievalSettings

__all__ = [
    "ChatTurn",
    "HybridRetriever",
    "Principal",
    "RetrievalSettings",
    "SearchFilters",
    "SearchRequest",
    "SearchResponse",
    "SearchResult",
    "truncate_text",
]
