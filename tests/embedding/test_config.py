"""Embedder configs: a variant per provider, validated up front, building its embedder; stored specs keep loading."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import SecretStr, ValidationError

from ragstream.embedding.config import (
    DashScopeEmbedding,
    EmbedderConfig,
    LocalEmbedding,
    OnnxEmbedding,
    OpenAICompatibleEmbedding,
    ProcessResources,
    embedder_config,
    parse_embedder,
    stored_embedder,
)
from ragstream.embedding.dashscope import DashScopeEmbedder
from ragstream.embedding.local import LocalUSEEmbedder
from ragstream.embedding.openai_compatible import OpenAICompatibleEmbedder
from ragstream.settings import EmbeddingProvider, EmbeddingSettings

KEYED = ProcessResources(SecretStr("sk-process-key"), threads=1, model_dir=Path("/nonexistent"))


PROVIDERS = {variant.model_fields["provider"].default for variant in get_args(get_args(EmbedderConfig)[0])}


def test_every_provider_of_the_settings_has_a_config_and_no_other() -> None:
    assert set(get_args(EmbeddingProvider)) == PROVIDERS


def test_the_readme_table_lists_every_provider_and_no_other() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    table = readme.split("| `provider` |", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"^\| `([\w-]+)`", table, re.MULTILINE)) == PROVIDERS


@pytest.mark.parametrize(
    ("given", "variant", "spec"),
    [
        # The flat form of the settings and of older stored specs: null means the provider's default.
        (
            {"provider": "local", "model": None, "dimension": None, "base_url": None},
            LocalEmbedding,
            {"provider": "local"},
        ),
        (
            {"provider": "onnx", "model": "bge-small-en-v1.5"},
            OnnxEmbedding,
            {"provider": "onnx", "model": "bge-small-en-v1.5"},
        ),
        (
            {"provider": "dashscope", "model": None, "dimension": 256},
            DashScopeEmbedding,
            {"provider": "dashscope", "dimension": 256},
        ),
        (
            '{"provider": "openai", "model": "bge-m3", "dimension": 1024, "base_url": "http://tei:8080/v1"}',
            OpenAICompatibleEmbedding,
            {"provider": "openai", "model": "bge-m3", "dimension": 1024, "base_url": "http://tei:8080/v1"},
        ),
    ],
)
def test_provider_picks_the_variant_and_the_spec_keeps_the_fields_given(
    given: Any, variant: type, spec: dict[str, Any]
) -> None:
    config = parse_embedder(given)
    assert type(config) is variant
    assert config.spec() == spec
    assert parse_embedder(config.spec()) == config


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"provider": "openai", "model": "m", "dimension": 8}, "base_url"),
        ({"provider": "openai", "base_url": "http://h/v1", "dimension": 8}, "model"),
        ({"provider": "openai", "model": "m", "base_url": "http://h/v1"}, "dimension"),
        ({"provider": "openai", "model": "m", "dimension": 8, "base_url": "ftp://h/v1"}, "scheme 'ftp'"),
        ({"provider": "dashscope", "dimension": 0}, "greater than or equal to 1"),
        ({"provider": "dashscope", "base_url": "file:///etc"}, "scheme 'file'"),
        ({"provider": "onnx", "model": "bge-huge"}, "unknown onnx model"),
        ({"provider": "local", "model": "bge-m3"}, "Extra inputs"),
        ({"provider": "dashscope", "api_key": "sk-x"}, "Extra inputs"),
        ({"provider": "cohere"}, "does not match any of the expected tags"),
        ({"model": "text-embedding-v3"}, "provider"),
    ],
)
def test_an_incomplete_or_wrong_config_is_refused_before_any_embedder_exists(given: Any, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        parse_embedder(given)


def test_stored_specs_load_with_the_fields_their_provider_always_ignored() -> None:
    # Stored by earlier versions from settings that had, say, a model left over beside ``local``.
    assert stored_embedder({"provider": "local", "model": "text-embedding-v3", "dimension": 1024}) == LocalEmbedding()
    assert stored_embedder({"provider": "onnx", "dimension": 512, "base_url": None}) == OnnxEmbedding()
    with pytest.raises(ValueError, match=r"unknown embedder spec fields: \['api_key'\]"):
        stored_embedder({"provider": "dashscope", "api_key": "sk-x"})
    with pytest.raises(ValidationError, match="base_url"):
        stored_embedder({"provider": "openai", "model": "m", "dimension": 8})


def test_the_settings_are_a_config_and_their_spec_holds_no_key() -> None:
    settings = EmbeddingSettings(provider="dashscope", dimension=512, api_key=SecretStr("sk-never-stored"))
    config = embedder_config(settings)
    assert config == DashScopeEmbedding(dimension=512)
    assert "sk-never-stored" not in str(config.spec()) and "sk-never-stored" not in repr(config)
    assert embedder_config(EmbeddingSettings(provider="local", model="left-over")) == LocalEmbedding()


async def test_each_config_builds_its_embedder_with_the_process_key() -> None:
    built = [
        parse_embedder({"provider": "local"}).create(KEYED),
        parse_embedder({"provider": "dashscope"}).create(KEYED),
        parse_embedder({"provider": "dashscope", "model": "text-embedding-v4", "dimension": 256}).create(KEYED),
        parse_embedder({"provider": "openai", "model": "bge-m3", "dimension": 1024, "base_url": "http://h/v1"}).create(
            KEYED
        ),
    ]
    try:
        assert [type(embedder) for embedder in built] == [
            LocalUSEEmbedder,
            DashScopeEmbedder,
            DashScopeEmbedder,
            OpenAICompatibleEmbedder,
        ]
        assert [(embedder.model_key, embedder.dimension) for embedder in built] == [
            ("use-multilingual-v3-512", 512),
            ("dashscope-text-embedding-v3-1024", 1024),
            ("dashscope-text-embedding-v4-256", 256),
            ("openai-compatible-bge-m3-1024", 1024),
        ]
    finally:
        for embedder in built:
            await embedder.aclose()


def test_dashscope_needs_the_process_key_at_build_time() -> None:
    keyless = ProcessResources(None, threads=1, model_dir=Path("/nonexistent"))
    with pytest.raises(ValueError, match="RAGSTREAM_EMBEDDER_API_KEY is required"):
        DashScopeEmbedding().create(keyless)
