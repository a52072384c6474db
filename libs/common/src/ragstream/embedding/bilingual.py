"""The default embedder: BGE small of each text's language beside USE multilingual v3, in one vector.

    embedder = BilingualEmbedder(LocalUSEEmbedder(), OnnxEmbedder("bge-small-zh-v1.5", models),
                                 OnnxEmbedder("bge-small-en-v1.5", models))
    vectors = await embedder.embed(["婚假可以休几天？", "How many days of marriage leave?"], "query")

Each vector is two blocks (``core.vectors.BLOCKS``), searched as two vector legs and fused with the
keyword leg, never added together: the first 512 dimensions hold BGE small zh for a Chinese text or
BGE small en (384 dimensions, zero-padded) for any other, the last 512 hold USE. BGE finds a
question's answer in its own language far better than USE (InsuranceQA nDCG@10 0.41 against 0.12
in English, 0.22 against 0.08 in Chinese); USE, trained across languages, still finds an English
page for a Chinese question and the reverse, where each BGE model sees only its own language.
Within the BGE block a Chinese query meets English chunks through a different model's vectors:
those cosines are near zero, so the block ranks the query's own language first, as it should.

Each block is L2-normalised and the whole vector scaled by 1/√2, so the vector is unit length too.
``warm_up`` loads all three models; without it, a model is loaded when a text of its language first
comes.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence

import numpy as np

from ragstream.core.vectors import BILINGUAL_MODEL_KEY, BLOCKS, TextKind, Vectors
from ragstream.embedding.base import Embedder
from ragstream.embedding.coalescing import BatchLimits

__all__ = ["BGE_MODELS", "BilingualEmbedder", "is_chinese"]

BGE_MODELS = ("bge-small-zh-v1.5", "bge-small-en-v1.5")
"""The BGE models (``embedding.onnx.MODELS``) of Chinese texts and of the others."""

_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN = re.compile(r"[A-Za-z]")


def is_chinese(text: str) -> bool:
    """Whether a text is mostly Chinese: a Han character carries about as much as three Latin letters,
    so "App 灰度发布的放量比例" is Chinese and an English page quoting one Chinese term is not."""
    han = len(_HAN.findall(text))
    return han > 0 and 3 * han >= len(_LATIN.findall(text))


class BilingualEmbedder:
    """USE for every text, and the BGE model of its language, as the blocks of one vector."""

    model_key = BILINGUAL_MODEL_KEY
    dimension = sum(block.dimension for block in BLOCKS[BILINGUAL_MODEL_KEY])

    def __init__(self, use: Embedder, chinese: Embedder, english: Embedder) -> None:
        bge, use_block = BLOCKS[BILINGUAL_MODEL_KEY]
        if use.dimension != use_block.dimension or chinese.dimension != bge.dimension:
            raise ValueError("the blocks' dimensions are those of USE and of BGE small zh")
        if english.dimension > bge.dimension:
            raise ValueError("BGE small en must fit the BGE block")
        self._use = use
        self._chinese = chinese
        self._english = english
        self._bge_block = bge
        self._use_block = use_block
        # USE's limits: its passes are the costlier, and each batch goes through it whole.
        self.batch_limits: BatchLimits | None = getattr(use, "batch_limits", None)

    async def warm_up(self) -> None:
        """Load all three models (fetching the BGE ones if missing), so a process that cannot have them
        fails at its start, not at its first search or document in the other language."""
        for model in (self._use, self._chinese, self._english):
            await model.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        texts = list(texts)
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        chinese = [index for index, text in enumerate(texts) if is_chinese(text)]
        english = [index for index, text in enumerate(texts) if not is_chinese(text)]
        use, *bge = await asyncio.gather(
            self._use.embed(texts, kind),
            *(
                model.embed([texts[index] for index in rows], kind)
                for model, rows in ((self._chinese, chinese), (self._english, english))
                if rows
            ),
        )
        parts = [rows for rows in (chinese, english) if rows]
        start = self._bge_block.start - 1
        for rows, vectors in zip(parts, bge, strict=True):
            out[rows, start : start + vectors.shape[1]] = vectors
        out[:, self._use_block.start - 1 :] = use
        out /= math.sqrt(2.0)
        return out

    async def aclose(self) -> None:
        models = (self._use, self._chinese, self._english)
        results = await asyncio.gather(*(model.aclose() for model in models), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
