"""Embedding providers behind one contract, their configs (one per provider) and the factory of the configured one."""

from __future__ import annotations

from ragstream.embedding.base import Embedder, EmbeddingError
from ragstream.embedding.config import (
    DashScopeEmbedding,
    EmbedderConfig,
    LocalEmbedding,
    OnnxEmbedding,
    OpenAICompatibleEmbedding,
    ProcessResources,
    embedder_config,
    parse_embedder,
)
from ragstream.settings import EmbeddingSettings

__all__ = [
    "DashScopeEmbedding",
    "Embedder",
    "EmbedderConfig",
    "EmbeddingError",
    "LocalEmbedding",
    "OnnxEmbedding",
    "OpenAICompatibleEmbedding",
    "create_embedder",
    "parse_embedder",
]


def create_embedder(settings: EmbeddingSettings) -> Embedder:
    """Build the provider the settings configure; a provider's code is imported only when it is used."""
    return embedder_config(settings).create(ProcessResources.from_settings(settings))
