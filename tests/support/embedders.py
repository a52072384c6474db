"""A deterministic second embedding model for re-index tests: hashed-word vectors, with pauses and failures on cue."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from ragstream.embedding.base import EmbeddingError, TextKind, Vectors
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import EmbeddingSettings, Settings
from tests.support.connections import private_database

if TYPE_CHECKING:
    from tests.support.fake_dashscope import FakeDashScope

__all__ = ["HashEmbedder", "dashscope_spec", "hash_vector", "private_runtime", "space_states"]


def hash_vector(text: str, dimension: int) -> Vectors:
    """A unit vector from the sum of per-word hashed vectors: texts sharing words point alike."""
    total = np.zeros(dimension)
    for word in text.lower().split():
        seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "big")
        total += np.random.default_rng(seed).standard_normal(dimension)
    return (total / (np.linalg.norm(total) or 1.0)).astype(np.float32)


class HashEmbedder:
    """Deterministic vectors from hashed words that can pause or fail on cue."""

    def __init__(self, model_key: str = "test-hash-64", dimension: int = 64, *, fail_on_call: int | None = None):
        self.model_key = model_key
        self.dimension = dimension
        self.fail_on_call = fail_on_call
        self.pause_on_call: int | None = None
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self.calls = 0
        self.texts: list[str] = []

    async def warm_up(self) -> None:
        return None

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        self.calls += 1
        if self.calls == self.pause_on_call:
            self.paused.set()
            await self.resume.wait()
        if self.calls == self.fail_on_call:
            raise EmbeddingError("the test embedder rejects this batch", retryable=False, provider="test")
        self.texts.extend(texts)
        return np.vstack([hash_vector(text, self.dimension) for text in texts])

    async def aclose(self) -> None:
        return None


async def space_states(runtime: Runtime) -> dict[str, tuple[str, bool]]:
    """Status of each embedding space and whether its table exists."""
    rows = await runtime.pool.fetch(
        "SELECT model_key, status, to_regclass(table_name) IS NOT NULL AS t FROM embedding_spaces"
    )
    return {row["model_key"]: (row["status"], row["t"]) for row in rows}


@asynccontextmanager
async def private_runtime(database_url: str, fake: FakeDashScope) -> AsyncIterator[Runtime]:
    """A runtime (local model active) on a database of its own, with the fake's key for a second
    model: re-indexes, pins and switches stay in it."""
    async with private_database(database_url) as dsn:
        settings = Settings(database_url=dsn, embedding=EmbeddingSettings(api_key=fake.api_key))
        async with open_runtime(settings, dsn) as runtime:
            yield runtime


def dashscope_spec(fake: FakeDashScope) -> dict[str, Any]:
    """The spec of the fake's text-embedding-v3 at 256 dimensions: model B of the re-index tests."""
    return {"provider": "dashscope", "model": "text-embedding-v3", "dimension": 256, "base_url": fake.base_url}
