"""The active embedding space and its embedder, as search and ingest use it: read briefly cached."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragstream.core.vectors import Vectors
from ragstream.embedding.base import Embedder
from ragstream.embedding.config import ProcessResources, embedder_config, stored_embedder
from ragstream.settings import EmbeddingSettings
from ragstream.storage.spaces import ChunkText, SpaceStore

__all__ = ["ActiveSpace", "Space", "embedding_spec"]


def embedding_spec(settings: EmbeddingSettings) -> dict[str, Any]:
    """What builds the same embedder in another process; never the API key, which stays in settings."""
    return embedder_config(settings).spec()


@dataclass(frozen=True, slots=True)
class Space:
    model_key: str
    table: str
    embedder: Embedder


class ActiveSpace:
    """Which space serves search and takes ingest's vectors, for the deployment (the active space) and
    for each connection (the space it is pinned to, else the active one), with their embedders.

    Read at most every ``ttl_s`` seconds, in one statement (``SpaceStore.layout``): ingest embeds a
    document with its connection's model as last read, and a switch in another process shows within
    ``ttl_s`` (vectors of the replaced model are refused at commit, and ``invalidate`` forgets the
    cache at once). Search reads the spaces in its own snapshot and uses this for the embedders only.
    Embedders for a model other than the configured one are built from the space's stored spec plus
    these settings' key and threads, and closed by ``aclose``.
    """

    def __init__(self, store: SpaceStore, settings: EmbeddingSettings, configured: Embedder, ttl_s: float = 2.0):
        self._store = store
        self._settings = settings
        self._configured = configured
        self._ttl_s = ttl_s
        self._embedders: dict[str, Embedder] = {configured.model_key: configured}
        self._owned: list[Embedder] = []
        self._cached: tuple[float, Space, dict[str, Space]] | None = None
        self._lock = asyncio.Lock()

    async def activate(self) -> Space:
        """The active space, the configured model's on a database that has none yet."""
        configured = self._configured
        await self._store.activate_if_none(configured.model_key, configured.dimension, embedding_spec(self._settings))
        return await self.current()

    async def current(self) -> Space:
        """The deployment's active space: that of every connection not pinned to a model."""
        return (await self._layout())[0]

    async def for_connection(self, connection_id: str) -> Space:
        """The connection's effective space: the one it is pinned to, else the active one."""
        active, pinned = await self._layout()
        return pinned.get(connection_id, active)

    async def _layout(self) -> tuple[Space, dict[str, Space]]:
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self._ttl_s:
                return self._cached[1], self._cached[2]
            active, pinned = await self._store.layout()
            if active is None:
                raise RuntimeError("no active embedding space: open the runtime first")
            spaces = {
                space.model_key: Space(space.model_key, space.table, self.embedder(space.model_key, space.spec))
                for space in (active, *pinned.values())
            }
            current = spaces[active.model_key]
            by_connection = {connection: spaces[space.model_key] for connection, space in pinned.items()}
            self._cached = (now, current, by_connection)
            return current, by_connection

    async def embedded_chunks(
        self, space: Space, document_id: str, texts: Sequence[str]
    ) -> list[tuple[ChunkText, Vectors]]:
        """The document's chunks of one of these ``texts`` that have a vector in ``space``, with their
        vectors: what the model of ``space`` embedded for the document's committed version."""
        return await self._store.embedded_chunks(space.table, document_id, texts)

    def embedder(self, model_key: str, spec: dict[str, Any] | None) -> Embedder:
        """The embedder of ``model_key``, built from its stored ``spec`` the first time."""
        embedder = self._embedders.get(model_key)
        if embedder is None:
            # A space recorded before specs were stored is taken to be of the configured model.
            embedder = self.build(spec or embedding_spec(self._settings))
            if embedder.model_key != model_key:
                raise RuntimeError(f"the spec of {model_key} builds {embedder.model_key}")
            self.adopt(embedder)
        return embedder

    def build(self, spec: dict[str, Any]) -> Embedder:
        """An embedder for ``spec`` (an ``EmbedderConfig``'s fields) with this process's key and threads;
        a ``ValueError`` says what is wrong with it."""
        return stored_embedder(spec).create(ProcessResources.from_settings(self._settings))

    async def resolve(self, spec: dict[str, Any]) -> Embedder:
        """The embedder ``spec`` names: the one this process has for its model already, else built
        and kept (closed by ``aclose``)."""
        built = self.build(spec)
        known = self._embedders.get(built.model_key)
        if known is not None:
            await built.aclose()
            return known
        self.adopt(built)
        return built

    def adopt(self, embedder: Embedder) -> None:
        """Use this embedder (a re-index's target) for its space from now on; closed by ``aclose``."""
        self._embedders[embedder.model_key] = embedder
        self._owned.append(embedder)

    def invalidate(self) -> None:
        self._cached = None

    async def aclose(self) -> None:
        for embedder in self._owned:
            await embedder.aclose()
