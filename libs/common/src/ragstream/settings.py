"""Configuration read from the environment, shared by the embedded runner and every service."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, GetCoreSchemaHandler, SecretStr, field_validator, model_validator
from pydantic_core import core_schema
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragstream.outbound import OutboundSettings, check_scheme

__all__ = [
    "BM25_B",
    "BM25_BIGRAM_WEIGHT",
    "BM25_K1",
    "ApiKey",
    "ApiKeys",
    "ChunkingSettings",
    "EmbeddingProvider",
    "EmbeddingSettings",
    "FolderSettings",
    "HttpUrlText",
    "LogSettings",
    "Role",
    "SearchLimitsSettings",
    "Settings",
    "StageRetrySettings",
    "VendorUrl",
]

# The keyword leg's BM25 parameters measured on InsuranceQA (docs/retrieval-quality.md): the settings'
# defaults, the SearchStore's, and the impact-ordered postings' reference since migration 0023.
BM25_K1 = 0.4
BM25_B = 0.6
BM25_BIGRAM_WEIGHT = 0.5


class Role(StrEnum):
    """What an API key may do: ``admin`` everything; ``search`` search and document reads, and it alone
    may assert the caller's principal (it stands for the chat core, which knows the user)."""

    ADMIN = "admin"
    SEARCH = "search"


@dataclass(frozen=True)
class ApiKey:
    role: Role
    secret: SecretStr


class ApiKeys:
    """``RAGSTREAM_API_KEYS``: comma-separated ``ROLE:SECRET`` pairs. Errors name the entry's position,
    never its text; the repr shows the roles only."""

    MIN_SECRET_CHARS = 16

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        if not keys:
            raise ValueError("RAGSTREAM_API_KEYS holds no key")
        digests = [hashlib.sha256(key.secret.get_secret_value().encode()).digest() for key in keys]
        if len(set(digests)) != len(digests):
            raise ValueError("RAGSTREAM_API_KEYS: a secret appears twice")
        self._keys = tuple(zip(digests, (key.role for key in keys), strict=True))

    @classmethod
    def parse(cls, text: str) -> ApiKeys:
        keys = []
        for position, entry in enumerate(text.split(","), start=1):
            role, separator, secret = entry.strip().partition(":")
            if not separator or role not in set(Role):
                raise ValueError(f"RAGSTREAM_API_KEYS entry {position}: expected ROLE:SECRET with ROLE admin or search")
            if len(secret) < cls.MIN_SECRET_CHARS or secret != secret.strip():
                raise ValueError(
                    f"RAGSTREAM_API_KEYS entry {position}: the secret needs at least {cls.MIN_SECRET_CHARS} "
                    "characters and no surrounding spaces"
                )
            keys.append(ApiKey(Role(role), SecretStr(secret)))
        return cls(keys)

    def role_of(self, presented: str) -> Role | None:
        """The role of the key ``presented``, or ``None``. Every key is compared, each in constant time
        over equal-length digests, so the time taken says nothing about which key came close."""
        digest = hashlib.sha256(presented.encode()).digest()
        found: Role | None = None
        for known, role in self._keys:
            if hmac.compare_digest(known, digest):
                found = role
        return found

    def roles(self) -> list[Role]:
        return [role for _, role in self._keys]

    def __repr__(self) -> str:
        return f"ApiKeys({', '.join(self.roles())})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(value: object) -> ApiKeys:
            if isinstance(value, ApiKeys):
                return value
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if not isinstance(value, str):
                raise ValueError("RAGSTREAM_API_KEYS must be text")
            return cls.parse(value)

        return core_schema.no_info_plain_validator_function(
            validate, serialization=core_schema.plain_serializer_function_ser_schema(repr)
        )


def _http_url(url: str) -> str:
    # The scheme at start-up; the address is checked on every request (ragstream.outbound).
    check_scheme(url)
    return url


HttpUrlText = Annotated[str, AfterValidator(_http_url)]
"""An http(s) URL with a host, kept as the text given."""
VendorUrl = HttpUrlText | None


class FolderSettings(BaseSettings):
    """Which server folders ``folder`` connections made over the API may read."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_")

    folder_roots: Annotated[
        str,
        Field(
            title="Folders that API-made folder connections may read",
            description="Colon-separated absolute paths; a connection's config.path must resolve inside one. "
            "Empty: none may be made over the API (ragstream ingest and up --source still register theirs).",
        ),
    ] = ""

    def roots(self) -> list[Path]:
        return [Path(part) for part in self.folder_roots.split(":") if part]


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


class LogSettings(BaseSettings):
    """How a process logs (see :mod:`ragstream.logs`): from which level, and as text or JSON lines."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_LOG_")

    level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        Field(title="Lowest level logged", description="Any case: info and INFO are the same."),
    ] = "INFO"
    format: Annotated[
        Literal["text", "json"],
        Field(
            title="Log line format",
            description="text: for people; json: one object per line with time, level, logger, message, "
            "exception and the connection, document and run ids of the work at hand.",
        ),
    ] = "text"

    @field_validator("level", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class SearchLimitsSettings(BaseSettings):
    """How many searches run at once (HTTP and gRPC together), how many may wait for a turn and how
    long, and how long one search statement may take. Unset limits follow the pool size."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_SEARCH_")

    max_in_flight: Annotated[
        int | None,
        Field(title="Searches running at once", description="Unset: the pool size minus 2 (at least 1).", ge=1),
    ] = None
    max_waiting: Annotated[
        int | None,
        Field(
            title="Searches waiting for a turn",
            description="Beyond them a search is answered 503 with Retry-After at once. Unset: 16 per running one.",
            ge=0,
        ),
    ] = None
    wait_timeout_s: Annotated[
        float, Field(title="Longest wait for a turn", description="Then 503 with Retry-After.", gt=0)
    ] = 30.0
    statement_timeout_s: Annotated[
        float,
        Field(
            title="Longest search statement",
            description="PostgreSQL statement_timeout (and idle-in-transaction timeout) of a search's snapshot; "
            "exceeded: 503 with Retry-After.",
            gt=0,
        ),
    ] = 10.0


EmbeddingProvider = Literal["local", "bilingual-pair", "bilingual", "onnx", "dashscope", "openai"]
"""``bilingual-pair`` (default): BGE small v1.5 of each text's language, BGE small zh v1 for Chinese texts,
beside USE; ``bilingual``: the previous default, without BGE small zh v1; ``local``: USE alone; ``onnx``: one
BGE model; ``dashscope`` and ``openai``: remote, with a key."""


class EmbeddingSettings(BaseSettings):
    """Which embedder runs: ``bilingual-pair`` (the default: BGE small zh or en v1.5 by each text's language
    and BGE small zh v1 for Chinese texts, beside USE), ``bilingual`` (the same without zh v1) and ``onnx``
    (one BGE model) take their models from Maven Central once, ``local`` (USE) needs no network,
    ``dashscope`` and ``openai`` need a key."""

    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_EMBEDDER_")

    provider: Annotated[EmbeddingProvider, Field(title="Embedding provider")] = "bilingual-pair"
    model: Annotated[str | None, Field(title="Model name", description="Provider default when unset.")] = None
    dimension: Annotated[int | None, Field(title="Vector dimension", description="Provider default when unset.")] = None
    base_url: Annotated[VendorUrl, Field(title="Endpoint base URL")] = None
    api_key: Annotated[SecretStr | None, Field(title="API key")] = None
    threads: Annotated[int, Field(title="CPU threads of the local model", ge=1)] = 2
    model_dir: Annotated[
        Path,
        Field(title="Model folder", description="Where the bilingual and onnx providers keep their models."),
    ] = Field(default_factory=lambda: Path.home() / ".cache" / "ragstream" / "models")


class Settings(BaseSettings):
    """Top-level settings; ``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS`` keep their usual names."""

    # Errors never echo an input: several of them are secrets.
    model_config = SettingsConfigDict(env_prefix="RAGSTREAM_", populate_by_name=True, hide_input_in_errors=True)

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
    parse_timeout_s: Annotated[
        float,
        Field(
            title="Seconds one document may take to parse",
            description="A parse over it is stopped and the document fails with 'parse_timeout'.",
            gt=0,
        ),
    ] = 60
    parse_memory_mb: Annotated[
        int,
        Field(
            title="Address space of a parser worker in MiB",
            description="A document that needs more fails with 'parse_memory'.",
            ge=256,
        ),
    ] = 1024
    parse_workers: Annotated[
        int, Field(title="Parser worker processes", description="Documents parsed at once per process.", ge=1)
    ] = 2
    ingest_workers: Annotated[
        int,
        Field(
            title="Documents in flight per ingest process",
            description=(
                "The embedded pipeline's workers and the embedder service's messages per batch. Each "
                "document is embedded and committed on its own; enough of them keep the embedder's "
                "batches full (64 texts for USE, 5 requests of 10 for DashScope)."
            ),
            ge=1,
        ),
    ] = 24
    hnsw_ef_search: Annotated[int, Field(title="HNSW ef_search for the vector leg", ge=10)] = 100
    # Set any of these five and they serve every embedding space; unset, a space fuses with its stored
    # or measured weights (retrieval/fusion.py), and these defaults (the USE tuning) serve the rest.
    fusion: Annotated[
        Literal["rrf", "convex", "dbsf"],
        Field(
            title="How the two legs are fused",
            description="convex: alpha · BM25 / best BM25 + (1 − alpha) · cosine; rrf: reciprocal rank fusion; "
            "dbsf: each leg's scores on the spread of its own results, the keyword leg weighing alpha.",
        ),
    ] = "convex"
    fusion_alpha: Annotated[
        float,
        Field(
            title="Keyword share of the convex or distribution-based fusion",
            description="0: vector only, 1: keyword only.",
            ge=0,
            le=1,
        ),
    ] = 0.6
    rrf_k: Annotated[int, Field(title="RRF k", description="Higher flattens the rank differences.", ge=1)] = 60
    rrf_vector_weight: Annotated[float, Field(title="RRF weight of the vector leg", ge=0)] = 1.0
    rrf_keyword_weight: Annotated[float, Field(title="RRF weight of the keyword leg", ge=0)] = 20.0
    bm25_k1: Annotated[
        float, Field(title="BM25 k1 of the keyword leg", description="Term-frequency saturation.", ge=0)
    ] = BM25_K1
    bm25_b: Annotated[
        float, Field(title="BM25 b of the keyword leg", description="Length normalisation.", ge=0, le=1)
    ] = BM25_B
    bm25_bigram_weight: Annotated[
        float,
        Field(title="Weight of the Chinese character-bigram field in BM25", description="0 ranks by words only.", ge=0),
    ] = BM25_BIGRAM_WEIGHT
    keyword_lists_mb: Annotated[
        int,
        Field(
            title="Memory for the keyword leg's whole term lists (MB)",
            description="A search whose keyword rounds go deep (frequent terms in a large corpus) sums its terms' "
            "whole postings lists in memory, kept while those terms do not change; 0 turns this off.",
            ge=0,
        ),
    ] = 256
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
    contextual_retrieval: Annotated[
        Literal["none", "dashscope"],
        Field(
            title="Contextual retrieval",
            description="`dashscope`: a chat model writes one line placing each chunk in its document, prepended to "
            "the text the embedder sees (cached per chunk, so unchanged chunks never ask again).",
        ),
    ] = "none"
    contextual_model: Annotated[str, Field(title="Chat model of contextual retrieval")] = "qwen-plus"
    contextual_document_chars: Annotated[
        int,
        Field(
            title="Document text shown with each chunk",
            description="The chat model sees the title and up to this many characters of the chunk's batch.",
            ge=500,
            le=100_000,
        ),
    ] = 8000
    dashscope_api_key: Annotated[
        SecretStr | None,
        Field(
            title="DashScope API key of the reranker and rephraser",
            description="Unset: RAGSTREAM_EMBEDDER_API_KEY when the embedder provider is dashscope.",
        ),
    ] = None
    dashscope_base_url: Annotated[
        VendorUrl,
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
            title="Seconds without progress after which a running run (sync, re-index, ...) counts as stale",
            description="A new run of its kind and scope then marks it failed instead of answering 409.",
            gt=0,
        ),
    ] = 1800
    max_concurrent_syncs: Annotated[
        int,
        Field(title="Runs of one kind running at once across replicas", description="The rest wait as queued.", ge=1),
    ] = 2
    sync_progress_interval_s: Annotated[
        float, Field(title="Seconds between progress writes of a running run (any kind)", gt=0, le=5)
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
    api_keys: Annotated[
        ApiKeys | None,
        Field(
            title="API keys of the HTTP and gRPC APIs",
            description="Comma-separated ROLE:SECRET pairs, ROLE admin or search, secrets of 16 characters or "
            "more, sent as `Authorization: Bearer SECRET`. Unset: `ragstream up` serves loopback only with every "
            "call allowed, and the services refuse to start unless RAGSTREAM_AUTH=none.",
        ),
    ] = None
    auth: Annotated[
        Literal["keys", "none"],
        Field(
            title="Authentication of the APIs",
            description="`none` serves every call without a key: only behind a proxy or mesh that authenticates.",
        ),
    ] = "keys"
    max_request_bytes: Annotated[
        int,
        Field(
            title="Largest request body",
            description="HTTP bodies beyond it get 413; also the gRPC API's largest received message.",
            ge=1024,
        ),
    ] = 1024 * 1024
    db_pool_size: Annotated[int, Field(title="Connections in the database pool", description="Per process.", ge=2)] = 8
    db_pool_timeout_s: Annotated[
        float,
        Field(
            title="Longest wait for a pool connection",
            description="Every acquire; exceeded, a search or API call answers 503 with Retry-After.",
            gt=0,
        ),
    ] = 5.0
    readiness_timeout_s: Annotated[
        float,
        Field(
            title="Database check of /readyz and gRPC health",
            description="Longest wait for a pool connection and its round trip; exceeded, not ready.",
            gt=0,
        ),
    ] = 1.0
    shutdown_timeout_s: Annotated[
        float,
        Field(
            title="Graceful shutdown",
            description="On SIGTERM, requests in flight get this long; then they are cancelled and the "
            "database connections still in use are closed.",
            gt=0,
        ),
    ] = 10.0
    search_limits: SearchLimitsSettings = Field(default_factory=SearchLimitsSettings)
    logs: LogSettings = Field(default_factory=LogSettings)
    chunking: ChunkingSettings = Field(default_factory=ChunkingSettings)
    stage_retry: StageRetrySettings = Field(default_factory=StageRetrySettings)
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings)
    folders: FolderSettings = Field(default_factory=FolderSettings)
    outbound: OutboundSettings = Field(default_factory=OutboundSettings)

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

    @field_validator("api_keys", mode="before")
    @classmethod
    def _blank_means_no_keys(cls, value: object) -> object:
        # Compose and Helm pass an unset variable as an empty one.
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _auth_is_consistent(self) -> Settings:
        if self.auth == "none" and self.api_keys is not None:
            raise ValueError("RAGSTREAM_AUTH=none contradicts RAGSTREAM_API_KEYS: set one of them")
        return self

    @model_validator(mode="after")
    def _dashscope_key_when_needed(self) -> Settings:
        # Fail at start-up, not on the first search that would quietly fall back.
        if "dashscope" in (self.reranker, self.rephraser, self.contextual_retrieval) and self.dashscope_key() is None:
            raise ValueError(
                "RAGSTREAM_RERANKER/RAGSTREAM_REPHRASER/RAGSTREAM_CONTEXTUAL_RETRIEVAL=dashscope need "
                "RAGSTREAM_DASHSCOPE_API_KEY "
                "(or a dashscope embedder with RAGSTREAM_EMBEDDER_API_KEY)"
            )
        return self
