"""Configuration read from the environment, shared by the embedded runner and every service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ChunkingSettings", "EmbeddingProvider", "EmbeddingSettings", "Settings", "StageRetrySettings"]


class ChunkingSettings(BaseSettings):
    """How documents are split; defaults follow the product spec (1,500 chars, 100 overlap)."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_CHUNK_")

    size: Annotated[int, Field(title="Target chunk size in characters", ge=100)] = 1500
    overlap: Annotated[int, Field(title="Overlap between neighbouring chunks", ge=0)] = 100
    batch_chunks: Annotated[
        int, Field(title="Chunks per Kafka message", description="Keeps messages far below 1 MB.", ge=1)
    ] = 32


class StageRetrySettings(BaseSettings):
    """How a stage retries a document's transient failure (a provider down, throttling) before it
    gives up on it: the document is then recorded failed and dead-lettered."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_STAGE_RETRY_")

    attempts: Annotated[
        int, Field(title="Attempts per document", description="1 disables the retries; each retry is counted.", ge=1)
    ] = 3
    backoff_s: Annotated[
        float, Field(title="First wait between attempts", description="Doubles on each retry, with jitter.", ge=0)
    ] = 1.0
    backoff_max_s: Annotated[float, Field(title="Longest wait between attempts", ge=0)] = 30.0


EmbeddingProvider = Literal["local", "onnx", "dashscope", "openai"]
"""``local``: USE; ``onnx``: BGE from Maven Central; ``dashscope`` and ``openai``: remote, with a key."""


class EmbeddingSettings(BaseSettings):
    """Which embedder runs: ``local`` (USE) needs no network, ``onnx`` (BGE) fetches its model once
    from Maven Central, ``dashscope`` and ``openai`` need a key."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_EMBEDDER_")

    provider: Annotated[EmbeddingProvider, Field(title="Embedding provider")] = "local"
    model: Annotated[str | None, Field(title="Model name", description="Provider default when unset.")] = None
    dimension: Annotated[int | None, Field(title="Vector dimension", description="Provider default when unset.")] = None
    base_url: Annotated[str | None, Field(title="Endpoint base URL")] = None
    api_key: Annotated[SecretStr | None, Field(title="API key")] = None
    threads: Annotated[int, Field(title="CPU threads of the local model", ge=1)] = 2
    model_dir: Annotated[
        Path,
        Field(title="Model folder", description="Where the onnx provider keeps the models it fetched."),
    ] = Field(default_factory=lambda: Path.home() / ".cache" / "ragstream" / "models")


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
    # Defaults tuned on InsuranceQA v2 `valid`, English and Chinese together (docs/retrieval-quality.md).
    fusion: Annotated[
        Literal["rrf", "convex"],
        Field(
            title="How the two legs are fused",
            description="convex: alpha · BM25 / best BM25 + (1 − alpha) · cosine; rrf: reciprocal rank fusion.",
        ),
    ] = "convex"
    fusion_alpha: Annotated[
        float,
        Field(title="Keyword share of the convex fusion", description="0: vector only, 1: keyword only.", ge=0, le=1),
    ] = 0.6
    rrf_k: Annotated[int, Field(title="RRF k", description="Higher flattens the rank differences.", ge=1)] = 60
    rrf_vector_weight: Annotated[float, Field(title="RRF weight of the vector leg", ge=0)] = 1.0
    rrf_keyword_weight: Annotated[float, Field(title="RRF weight of the keyword leg", ge=0)] = 20.0
    bm25_k1: Annotated[
        float, Field(title="BM25 k1 of the keyword leg", description="Term-frequency saturation.", ge=0)
    ] = 0.4
    bm25_b: Annotated[
        float, Field(title="BM25 b of the keyword leg", description="Length normalisation.", ge=0, le=1)
    ] = 0.6
    bm25_bigram_weight: Annotated[
        float,
        Field(title="Weight of the Chinese character-bigram field in BM25", description="0 ranks by words only.", ge=0),
    ] = 0.5
    direct_search_timeout_s: Annotated[
        float,
        Field(
            title="Time a platform's live search may take",
            description="For connections with RAG off; a platform slower than this is left out and listed as degraded.",
            gt=0,
        ),
    ] = 30.0
    reranker: Annotated[
        Literal["none", "dashscope"],
        Field(
            title="Reranker of the fused candidates",
            description="`dashscope`: DashScope text-rerank; a failure or timeout keeps the fused order.",
        ),
    ] = "none"
    reranker_model: Annotated[str, Field(title="Rerank model", description="gte-rerank-v2 or qwen3-rerank.")] = (
        "gte-rerank-v2"
    )
    rephraser: Annotated[
        Literal["none", "dashscope"],
        Field(
            title="Rephraser of follow-up questions",
            description="`dashscope`: a chat model on DashScope's OpenAI-compatible route turns a question with "
            "history into a standalone one; a failure searches the raw question.",
        ),
    ] = "none"
    rephraser_model: Annotated[str, Field(title="Chat model of the rephraser")] = "qwen-plus"
    dashscope_api_key: Annotated[
        SecretStr | None,
        Field(
            title="DashScope API key of the reranker and rephraser",
            description="Unset: RAGSTREAM_EMBEDDER_API_KEY when the embedder provider is dashscope.",
        ),
    ] = None
    dashscope_base_url: Annotated[
        str | None,
        Field(
            title="DashScope host of the reranker and rephraser",
            description="Like https://dashscope-intl.aliyuncs.com; the rephraser appends /compatible-mode/v1. "
            "Unset: RAGSTREAM_EMBEDDER_BASE_URL when the embedder provider is dashscope, else the Beijing host.",
        ),
    ] = None
    credential_keys: Annotated[
        SecretStr | None,
        Field(
            title="Fernet keys of connection credentials",
            description="Comma-separated; the first encrypts, every one decrypts, so a new key goes first and the "
            "old one stays until `ragstream credentials rotate` has re-encrypted every connection. Unset: "
            "connections cannot be given credentials.",
        ),
    ] = None
    sync_stale_timeout_s: Annotated[
        float,
        Field(
            title="Seconds without progress after which a running sync counts as stale",
            description="A new sync of the connection then marks it failed instead of answering 409.",
            gt=0,
        ),
    ] = 1800
    max_concurrent_syncs: Annotated[
        int, Field(title="Syncs running at once across replicas", description="The rest wait as queued.", ge=1)
    ] = 2
    sync_progress_interval_s: Annotated[
        float, Field(title="Seconds between progress writes of a running sync", gt=0, le=5)
    ] = 2
    scheduler_enabled: Annotated[
        bool,
        Field(
            title="Run scheduled syncs",
            description="Each connection's schedule_seconds; one replica leads through an advisory lock.",
        ),
    ] = True
    scheduler_interval_s: Annotated[
        float, Field(title="Seconds between scheduler steps", description="How soon a due sync is queued.", gt=0)
    ] = 30
    grpc_port: Annotated[
        int,
        Field(
            title="Port of the retriever's gRPC API",
            description="ragstream.v1.Retrieval with gRPC health checking and reflection; 0 disables it. "
            "`ragstream up --grpc-port` reads it too.",
            ge=0,
            le=65535,
        ),
    ] = 50051
    grpc_host: Annotated[
        str,
        Field(
            title="Address the retriever service's gRPC API listens on",
            description="All interfaces, as the HTTP API in its image; `ragstream up` uses its --host.",
        ),
    ] = "0.0.0.0"
    chunking: ChunkingSettings = Field(default_factory=ChunkingSettings)
    stage_retry: StageRetrySettings = Field(default_factory=StageRetrySettings)
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings)

    def dashscope_key(self) -> SecretStr | None:
        """The key for DashScope rerank and rephrasing: its own, else the DashScope embedder's."""
        if self.dashscope_api_key is not None:
            return self.dashscope_api_key
        return self.embedding.api_key if self.embedding.provider == "dashscope" else None

    def dashscope_host(self) -> str | None:
        """The DashScope host for rerank and rephrasing when configured; ``None`` means the default."""
        if self.dashscope_base_url:
            return self.dashscope_base_url
        return self.embedding.base_url if self.embedding.provider == "dashscope" else None

    @model_validator(mode="after")
    def _dashscope_key_when_needed(self) -> Settings:
        # Fail at start-up, not on the first search that would quietly fall back.
        if "dashscope" in (self.reranker, self.rephraser) and self.dashscope_key() is None:
            raise ValueError(
                "RAGSTREAM_RERANKER/RAGSTREAM_REPHRASER=dashscope need RAGSTREAM_DASHSCOPE_API_KEY "
                "(or a dashscope embedder with RAGSTREAM_EMBEDDER_API_KEY)"
            )
        return self
