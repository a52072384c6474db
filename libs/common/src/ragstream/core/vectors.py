"""The vector types every layer shares: what an embedder returns, and which side of a search a text is."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["TextKind", "Vectors"]

TextKind = Literal["document", "query"]
"""``document``: a chunk being indexed; ``query``: a question being searched (some models embed them differently)."""

Vectors = npt.NDArray[np.float32]
"""L2-normalised float32 vectors, one row per text."""
