"""Optional reranking of the fused candidates; any failure falls back to the fused order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Reranker"]


class Reranker(Protocol):
    """Scores candidate texts against the query; returns ``(candidate index, relevance)`` best first."""

    async def rerank(self, query: str, texts: Sequence[str], top_n: int) -> list[tuple[int, float]]: ...

    async def aclose(self) -> None: ...
