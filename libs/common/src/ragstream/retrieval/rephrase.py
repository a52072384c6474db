"""Optional query rephrasing: conversation history in, one standalone question out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ragstream.retrieval.models import ChatTurn

__all__ = ["QueryRephraser"]


class QueryRephraser(Protocol):
    async def rephrase(self, query: str, history: Sequence[ChatTurn]) -> str: ...

    async def aclose(self) -> None: ...
