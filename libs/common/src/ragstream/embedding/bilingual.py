"""The default embedder: BGE small of each text's language beside USE multilingual v3, in one vector.

    embedder = BilingualEmbedder(
        LocalUSEEmbedder(),
        LanguageModels(OnnxEmbedder("bge-small-zh-v1.5", models), OnnxEmbedder("bge-small-en-v1.5", models)),
        LanguageModels(OnnxEmbedder("bge-small-zh", models)),
        model_key=BILINGUAL_PAIR_MODEL_KEY,
    )
    vectors = await embedder.embed(["婚假可以休几天？", "How many days of marriage leave?"], "query")

Each vector is made of blocks (``core.vectors.BLOCKS``), each searched as a vector leg of its own and
fused with the keyword leg, never added together. Each BGE block holds, for a Chinese text, a BGE small
zh model, and for any other text a BGE small en model (384 dimensions, zero-padded) or, in a block
without one, the first block's English vector again (no block is ever all zeros: a zero vector has no
cosine); the last block holds USE. BGE finds a question's answer in its own language far better than
USE (InsuranceQA nDCG@10 0.41 against 0.12 in English, 0.25 against 0.08 in Chinese); USE, trained
across languages, still finds an English page for a Chinese question and the reverse, where each BGE
model sees only its own language.
Within a BGE block a Chinese query meets English chunks through a different model's vectors: those
cosines are near zero, so the block ranks the query's own language first, as it should.

The default space (``BILINGUAL_PAIR_MODEL_KEY``) has two BGE blocks: v1.5 of the text's language, and
BGE small zh v1 for Chinese texts. In Chinese the two generations rank differently enough that fusing
both beats either; in English BGE small en v1 added 0.002 nDCG@10 at 1.5 times the embedding time of
v1.5, so English texts repeat their v1.5 vector in the second block, which English queries do not
search (docs/retrieval-quality.md). The previous default (``BILINGUAL_MODEL_KEY``) has the v1.5 block
only.

Each block is L2-normalised and the whole vector scaled by 1/√(blocks), so the vector is unit length too.
``warm_up`` loads every model; without it, a model is loaded when a text of its language first comes.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragstream.core.vectors import BILINGUAL_MODEL_KEY, BILINGUAL_PAIR_MODEL_KEY, BLOCKS, TextKind, Vectors
from ragstream.embedding.base import Embedder
from ragstream.embedding.coalescing import BatchLimits

__all__ = ["BGE_MODELS", "BilingualEmbedder", "LanguageModels", "bge_model_names", "is_chinese"]

BGE_MODELS: dict[str, tuple[tuple[str, str | None], ...]] = {
    BILINGUAL_MODEL_KEY: (("bge-small-zh-v1.5", "bge-small-en-v1.5"),),
    BILINGUAL_PAIR_MODEL_KEY: (("bge-small-zh-v1.5", "bge-small-en-v1.5"), ("bge-small-zh", None)),
}
"""Per bilingual space, its BGE blocks in order, each as the models (``embedding.onnx.MODELS``) of Chinese
texts and of the others; None: the others repeat the first block's vector."""

_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN = re.compile(r"[A-Za-z]")


def bge_model_names() -> list[str]:
    """Every BGE model a bilingual space runs, each once: what ``make models`` and the image fetch."""
    names = (name for blocks in BGE_MODELS.values() for pair in blocks for name in pair if name is not None)
    return list(dict.fromkeys(names))


def is_chinese(text: str) -> bool:
    """Whether a text is mostly Chinese: a Han character carries about as much as three Latin letters,
    so "App 灰度发布的放量比例" is Chinese and an English page quoting one Chinese term is not."""
    han = len(_HAN.findall(text))
    return han > 0 and 3 * han >= len(_LATIN.findall(text))


@dataclass(frozen=True, slots=True)
class LanguageModels:
    """What one BGE block holds: ``chinese`` embeds the Chinese texts, ``english`` every other; without
    ``english``, the others repeat the first block's vector."""

    chinese: Embedder
    english: Embedder | None = None


class BilingualEmbedder:
    """USE for every text and, per BGE block, the model of the text's language, as the blocks of one vector."""

    def __init__(self, use: Embedder, *bge: LanguageModels, model_key: str = BILINGUAL_PAIR_MODEL_KEY) -> None:
        *bge_blocks, use_block = BLOCKS[model_key]
        if len(bge) != len(bge_blocks):
            raise ValueError(f"{model_key} has {len(bge_blocks)} BGE blocks, not {len(bge)}")
        first_english = bge[0].english if bge else None
        if first_english is None:
            raise ValueError("the first BGE block needs a model for the texts that are not Chinese")
        if use.dimension != use_block.dimension:
            raise ValueError("the last block's dimension is that of USE")
        for block, models in zip(bge_blocks, bge, strict=True):
            english = models.english or first_english
            if models.chinese.dimension != block.dimension or english.dimension > block.dimension:
                raise ValueError(f"the BGE models of block {block.name} do not fit it")
        self.model_key = model_key
        self.dimension = sum(block.dimension for block in BLOCKS[model_key])
        self._use = use
        self._bge = bge
        self._bge_blocks = bge_blocks
        self._use_block = use_block
        # USE's limits: its passes are the costlier, and each batch goes through it whole.
        self.batch_limits: BatchLimits | None = getattr(use, "batch_limits", None)

    def _models(self) -> list[Embedder]:
        pairs = ((models.chinese, models.english) for models in self._bge)
        return [self._use, *(model for pair in pairs for model in pair if model is not None)]

    async def warm_up(self) -> None:
        """Load every model (fetching the BGE ones if missing), so a process that cannot have them fails
        at its start, not at its first search or document in the other language."""
        for model in self._models():
            await model.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        texts = list(texts)
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        chinese = [index for index, text in enumerate(texts) if is_chinese(text)]
        english = [index for index, text in enumerate(texts) if not is_chinese(text)]
        placed = [
            (block, rows, model)
            for block, models in zip(self._bge_blocks, self._bge, strict=True)
            for model, rows in ((models.chinese, chinese), (models.english, english))
            if rows and model is not None
        ]
        use, *bge = await asyncio.gather(
            self._use.embed(texts, kind),
            *(model.embed([texts[row] for row in rows], kind) for _, rows, model in placed),
        )
        for (block, rows, _), vectors in zip(placed, bge, strict=True):
            out[rows, block.start - 1 : block.start - 1 + vectors.shape[1]] = vectors
        first = self._bge_blocks[0]
        for block, models in zip(self._bge_blocks, self._bge, strict=True):
            if models.english is None and english:
                out[english, block.start - 1 : block.start - 1 + block.dimension] = first.of(out[english])
        out[:, self._use_block.start - 1 :] = use
        out /= math.sqrt(len(BLOCKS[self.model_key]))
        return out

    async def aclose(self) -> None:
        results = await asyncio.gather(*(model.aclose() for model in self._models()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
