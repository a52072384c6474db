"""The embedder contract every provider implements, so stages never know which one runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ragstream.core.errors import ProviderError
from ragstream.core.vectors import TextKind, Vectors

__all__ = ["Embedder", "EmbeddingError", "TextKind", "Vectors"]


class EmbeddingError(ProviderError):
    """An embedding request failed; ``retryable`` tells the caller whether to try again later."""

    def __init__(self, message: str, *, retryable: bool, provider: str) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.provider = provider


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors of a fixed dimension.

    ``model_key`` names the vector space (model + dimension): vectors with different keys live in
    different tables, so two models can be indexed side by side while one replaces the other.
    """

    @property
    def model_key(self) -> str: ...

    @property
    def dimension(self) -> int: ...

    async def warm_up(self) -> None: ...

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        """Return an array of shape ``(len(texts), dimension)``; raise ``EmbeddingError`` on failure."""
        ...

    async def aclose(self) -> None: ...
