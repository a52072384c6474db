"""The vector types every layer shares: what an embedder returns, and which side of a search a text is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["BILINGUAL_MODEL_KEY", "BILINGUAL_PAIR_MODEL_KEY", "BLOCKS", "Block", "TextKind", "Vectors", "vector_blocks"]

TextKind = Literal["document", "query"]
"""``document``: a chunk being indexed; ``query``: a question being searched (some models embed them differently)."""

Vectors = npt.NDArray[np.float32]
"""L2-normalised float32 vectors, one row per text."""


@dataclass(frozen=True, slots=True)
class Block:
    """A run of a vector's dimensions that one model filled and that is searched on its own.

    A space whose vectors are made of blocks (``BLOCKS``) gets one HNSW index per block, on the
    expression ``sql(column)``, and runs one vector leg per block: two models' cosines are never added.
    ``start`` counts from 1, as pgvector's ``subvector`` does.
    """

    name: str
    start: int
    dimension: int

    def sql(self, column: str) -> str:
        """The block as a ``vector`` of its own: the indexed expression, written the same way in searches."""
        return f"(subvector({column}, {self.start}, {self.dimension})::vector({self.dimension}))"

    def of(self, vector: Vectors) -> Vectors:
        """The block's part of a full vector (or of each row of a matrix)."""
        part: Vectors = vector[..., self.start - 1 : self.start - 1 + self.dimension]
        return part


BILINGUAL_MODEL_KEY = "bilingual-bge-small-use-1024"
"""The previous default space: BGE small v1.5 of the text's language (zh or en) beside USE multilingual v3."""

BILINGUAL_PAIR_MODEL_KEY = "bilingual-bge-small-pair-use-1536"
"""The default space: BGE small v1.5 of the text's language, BGE small zh v1 for a Chinese text, and USE."""

BLOCKS: dict[str, tuple[Block, ...]] = {
    BILINGUAL_MODEL_KEY: (Block("bge", 1, 512), Block("use", 513, 512)),
    BILINGUAL_PAIR_MODEL_KEY: (Block("bge", 1, 512), Block("bge_v1", 513, 512), Block("use", 1025, 512)),
}
"""The model keys whose vectors are made of blocks searched apart; every other space is one block."""


def vector_blocks(model_key: str) -> tuple[Block, ...]:
    """The blocks of ``model_key``'s vectors, empty when the whole vector is searched as one."""
    return BLOCKS.get(model_key, ())
