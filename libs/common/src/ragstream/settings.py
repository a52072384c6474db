"""Configuration read from the environment, shared by the embedded runner and every service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ChunkingSettings", "EmbeddingSettings", "Settings"]


class ChunkingSettings(BaseSettings):
    """How documents are split; defaults follow the product spec (1,500 chars, 100 overlap)."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_CHUNK_")

    size: Annotated[int, Field(title="Target chunk size in characters", ge=100)] = 1500
    overlap: Annotated[int, Field(title="Overlap between neighbouring chunks", ge=0)] = 100
    batch_chunks: Annotated[
        int, Field(title="Chunks per Kafka message", description="Keeps messages far below 1 MB.", ge=1)
    ] = 32


class EmbeddingSettings(BaseSettings):
    """Which embedder runs; ``local`` needs no network, ``dashscope`` and ``openai`` need a key."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_EMBEDDER_")

    provider: Annotated[Literal["local", "dashscope", "openai"], Field(title="Embedding provider")] = "local"
    model: Annotated[str | None, Field(title="Model name", description="Provider default when unset.")] = None
    dimension: Annotated[int | None, Field(title="Vector dimension", description="Provider default when unset.")] = None
    base_url: Annotated[str | None, Field(title="Endpoint base URL")] = None
    api_key: Annotated[SecretStr | None, Field(title="API key")] = None
    threads: Annotated[int, Field(title="CPU threads of the local model", ge=1)] = 2


class Settings(BaseSettings):
    """Top-level settings; ``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS`` keep their usual names."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_", populate_by_name=True)

    data_dir: Annotated[
        Path, Field(title="Embedded store folder", description="Holds the embedded PostgreSQL cluster.")
    ] = Path.home() / ".local" / "share" / "ragstream"
    database_url: Annotated[
        str | None,
        Field(title="PostgreSQL DSN", validation_alias="DATABASE_URL", description="Unset: embedded PostgreSQL."),
    ] = None
    kafka_bootstrap_servers: Annotated[
        str, Field(title="Kafka bootstrap servers", validation_alias="KAFKA_BOOTSTRAP_SERVERS")
    ] = "127.0.0.1:9092"
    kafka_session_timeout_ms: Annotated[
        int, Field(title="Consumer session timeout", description="A dead consumer's partitions move after this.")
    ] = 10_000
    max_document_bytes: Annotated[
        int, Field(title="Largest document accepted", description="Bigger ones fail with 'too_large'.")
    ] = 16 * 1024 * 1024
    hnsw_ef_search: Annotated[int, Field(title="HNSW ef_search for the vector leg", ge=10)] = 100
    chunking: ChunkingSettings = Field(default_factory=ChunkingSettings)
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings)
