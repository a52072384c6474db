"""Embedding providers behind one contract; ``create_embedder`` builds the one the settings configure."""

from __future__ import annotations

from ragstream.embedding.base import Embedder, EmbeddingError
from ragstream.embedding.config import ProcessResources, embedder_config
from ragstream.settings import EmbeddingSettings

__all__ = ["Embedder", "EmbeddingError", "create_embedder"]


def create_embedder(settings: EmbeddingSettings) -> Embedder:
    """Build the configured provider (``embedding.config``); a provider's code is imported only when used."""
    return embedder_config(settings).create(ProcessResources.from_settings(settings))
