"""Embedding providers behind one contract; ``create_embedder`` picks one from settings."""

from __future__ import annotations

from ragstream.embedding.base import Embedder, EmbeddingError
from ragstream.settings import EmbeddingSettings

__all__ = ["Embedder", "EmbeddingError", "create_embedder"]


def create_embedder(settings: EmbeddingSettings) -> Embedder:
    """Build the configured provider; remote ones import lazily so the local default needs no extras."""
    if settings.provider == "local":
        from ragstream.embedding.local import LocalUSEEmbedder

        return LocalUSEEmbedder(threads=settings.threads)
    if settings.provider == "onnx":
        from ragstream.embedding.onnx import OnnxEmbedder

        return OnnxEmbedder(settings.model or "bge-small-zh-v1.5", settings.model_dir, threads=settings.threads)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    if settings.provider == "dashscope":
        from ragstream.embedding.dashscope import DEFAULT_BASE_URL, DashScopeEmbedder

        if key is None:
            raise ValueError("RAGSTREAM_EMBEDDER_API_KEY is required for the dashscope provider")
        return DashScopeEmbedder(
            api_key=key,
            model=settings.model or "text-embedding-v3",
            dimension=settings.dimension or 1024,
            base_url=settings.base_url or DEFAULT_BASE_URL,
        )
    from ragstream.embedding.openai_compatible import OpenAICompatibleEmbedder

    if settings.base_url is None or settings.model is None or settings.dimension is None:
        raise ValueError("the openai provider needs RAGSTREAM_EMBEDDER_BASE_URL, _MODEL and _DIMENSION")
    return OpenAICompatibleEmbedder(
        base_url=settings.base_url, model=settings.model, dimension=settings.dimension, api_key=key
    )
