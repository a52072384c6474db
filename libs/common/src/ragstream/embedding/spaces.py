"""The active embedding space and its embedder, as search and ingest use it: read briefly cached."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from ragstream.embedding import create_embedder
from ragstream.embedding.base import Embedder
from ragstream.settings import EmbeddingSettings
from ragstream.storage.spaces import SpaceStore

__all__ = ["ActiveSpace", "Space", "embedding_spec"]

_SPEC_FIELDS = {"provider", "model", "dimension", "base_url"}


def embedding_spec(settings: EmbeddingSettings) -> dict[str, Any]:
    """What builds the same embedder in another process; never the API key, which stays in settings."""
    return settings.model_dump(include=_SPEC_FIELDS)


@dataclass(frozen=True, slots=True)
class Space:
    model_key: str
    table: str
    embedder: Embedder


class ActiveSpace:
    """Which space serves search and takes ingest's vectors, with the embedder of its model.

    Read at most every ``ttl_s`` seconds: a search takes one ``Space`` and uses it for its whole
    vector leg, so it never mixes models; a switch in another process shows within ``ttl_s`` (and at
    once in a search that finds the old table dropped, which calls ``invalidate``). Embedders for a
    model other than the configured one are built from the space's stored spec plus these settings'
    key and threads, and closed by ``aclose``.
    """

    def __init__(self, store: SpaceStore, settings: EmbeddingSettings, configured: Embedder, ttl_s: float = 2.0):
        self._store = store
        self._settings = settings
        self._configured = configured
        self._ttl_s = ttl_s
        self._embedders: dict[str, Embedder] = {configured.model_key: configured}
        self._owned: list[Embedder] = []
        self._cached: tuple[float, Space] | None = None
        self._lock = asyncio.Lock()

    async def activate(self) -> Space:
        """The active space, the configured model's on a database that has none yet."""
        configured = self._configured
        await self._store.activate_if_none(configured.model_key, configured.dimension, embedding_spec(self._settings))
        return await self.current()

    async def current(self) -> Space:
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self._ttl_s:
                return self._cached[1]
            active = await self._store.active()
            if active is None:
                raise RuntimeError("no active embedding space: open the runtime first")
            embedder = self._embedders.get(active.model_key)
            if embedder is None:
                embedder = self.build(active.spec or {})
                if embedder.model_key != active.model_key:
                    raise RuntimeError(f"the spec of {active.model_key} builds {embedder.model_key}")
                self.adopt(embedder)
            space = Space(active.model_key, active.table, embedder)
            self._cached = (now, space)
            return space

    def build(self, spec: dict[str, Any]) -> Embedder:
        """An embedder for ``spec`` (provider, model, dimension, base_url) with this process's key."""
        unknown = set(spec) - _SPEC_FIELDS
        if unknown:
            raise ValueError(f"unknown embedder spec fields: {sorted(unknown)}")
        return create_embedder(self._settings.model_copy(update=spec))

    def adopt(self, embedder: Embedder) -> None:
        """Use this embedder (a re-index's target) for its space from now on; closed by ``aclose``."""
        self._embedders[embedder.model_key] = embedder
        self._owned.append(embedder)

    def invalidate(self) -> None:
        self._cached = None

    async def aclose(self) -> None:
        for embedder in self._owned:
            await embedder.aclose()
