"""The BGE embedder: its Maven Central fetch (checksum, atomic unpack), its vectors, and a real sync + search."""

from __future__ import annotations

import hashlib
import io
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.embedding import create_embedder, onnx
from ragstream.embedding.base import EmbeddingError
from ragstream.embedding.onnx import MODELS, OnnxEmbedder, fetch_model
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import open_runtime
from ragstream.settings import EmbeddingSettings, Settings
from tests.support.connections import private_database

# The fake vendors listen on 127.0.0.1.
pytestmark = pytest.mark.usefixtures("private_networks")

# Fetched once from Maven Central (like the Kafka jars) and kept with the repository's caches.
MODEL_DIR = Path(__file__).resolve().parents[2] / ".cache" / "models"
ZH = "bge-small-zh-v1.5"


@pytest.fixture(scope="module")
def zh_embedder() -> Iterator[OnnxEmbedder]:
    yield OnnxEmbedder(ZH, MODEL_DIR)


class _JarServer:
    """Serves one jar's bytes over HTTP, counting the requests, like a Maven repository would."""

    def __init__(self, body: bytes) -> None:
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_port}/model.jar"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _jar(stem: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"{stem}.onnx", b"graph")
        archive.writestr(f"{stem}-tokenizer.json", b"{}")
        archive.writestr("README", b"not unpacked")
    return buffer.getvalue()


def test_fetch_checks_the_pinned_checksum_and_fetches_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = _jar(MODELS[ZH].stem)
    server = _JarServer(body)
    models, maven = tmp_path / "models", tmp_path / "m2"  # no jar in this local Maven repository
    try:
        monkeypatch.setattr(type(MODELS[ZH]), "jar_url", property(lambda _: server.url))
        tampered = replace(MODELS[ZH], sha256=hashlib.sha256(b"another jar").hexdigest())
        with pytest.raises(EmbeddingError, match="not the pinned") as refused:
            fetch_model(tampered, models, maven=maven)
        assert not refused.value.retryable
        assert list(models.iterdir()) == []  # nothing half-unpacked is left to be mistaken for a model

        pinned = replace(MODELS[ZH], sha256=hashlib.sha256(body).hexdigest())
        folder = fetch_model(pinned, models, maven=maven)
        unpacked = sorted(path.name for path in folder.iterdir())
        assert unpacked == [f"{pinned.stem}-tokenizer.json", f"{pinned.stem}.onnx"]
        assert fetch_model(pinned, models, maven=maven) == folder
        assert server.requests == 2
    finally:
        server.close()


def test_a_jar_maven_already_fetched_is_unpacked_without_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make models`` leaves the jars in the local Maven repository (``mvn dependency:get``): the model
    comes from there, checked against the same pinned checksum, and no request goes out."""
    body = _jar(MODELS[ZH].stem)
    pinned = replace(MODELS[ZH], sha256=hashlib.sha256(body).hexdigest())
    maven = tmp_path / "m2"
    jar = pinned.local_jar(maven)
    assert jar.parts[-4:-1] == ("langchain4j", pinned.artifact, pinned.version)
    jar.parent.mkdir(parents=True)
    jar.write_bytes(body)

    def no_download(*args: object) -> Path:
        raise AssertionError("the jar in the local Maven repository is used, nothing is downloaded")

    monkeypatch.setattr(onnx, "_download", no_download)

    folder = fetch_model(pinned, tmp_path / "models", maven=maven)

    assert (folder / f"{pinned.stem}.onnx").read_bytes() == b"graph"

    downloads: list[str] = []

    def download_the_pinned_jar(model: onnx.OnnxModel, target: Path, timeout_s: float) -> Path:
        downloads.append(model.jar_url)
        target.write_bytes(body)
        return target

    monkeypatch.setattr(onnx, "_download", download_the_pinned_jar)
    jar.write_bytes(_jar("other"))  # a foreign or truncated jar in the local repository is passed over
    folder = fetch_model(pinned, tmp_path / "elsewhere", maven=maven)
    assert (folder / f"{pinned.stem}.onnx").read_bytes() == b"graph" and downloads == [pinned.jar_url]


def test_settings_build_the_onnx_embedder() -> None:
    embedder = create_embedder(EmbeddingSettings(provider="onnx", model_dir=MODEL_DIR))
    assert isinstance(embedder, OnnxEmbedder)
    assert (embedder.model_key, embedder.dimension) == ("bge-small-zh-v1.5-512", 512)
    with pytest.raises(ValueError, match="unknown onnx model"):
        create_embedder(EmbeddingSettings(provider="onnx", model="bge-huge", model_dir=MODEL_DIR))


async def test_vectors_are_unit_length_and_do_not_depend_on_the_batch(zh_embedder: OnnxEmbedder) -> None:
    texts = ["退保", "分红型保险的红利不是保证的，取决于保险公司的经营状况。" * 6, "Term life insurance", ""]
    together = await zh_embedder.embed(texts)
    assert together.shape == (4, 512) and together.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    # One text per forward pass: a vector does not depend on what it was embedded with.
    for text, vector in zip(texts, together, strict=True):
        assert (await zh_embedder.embed([text]))[0].tobytes() == vector.tobytes()


async def test_a_chinese_question_finds_its_answer(zh_embedder: OnnxEmbedder) -> None:
    answers = [
        "退保时，保险公司会扣除一定比例的手续费，第一年通常最高，之后逐年降低。",
        "汽车保险分为交强险和商业险，交强险是国家规定必须购买的。",
        "Life insurance pays a death benefit to the named beneficiary.",
    ]
    documents = await zh_embedder.embed(answers)
    question = (await zh_embedder.embed(["提前解除保险合同要扣多少钱？"], kind="query"))[0]
    assert int(np.argmax(documents @ question)) == 0


def test_the_tokenizer_counts_the_models_own_tokens(zh_embedder: OnnxEmbedder) -> None:
    tokenizer = zh_embedder.tokenizer()
    assert tokenizer.count("") == 0
    assert tokenizer.count("退保手续费") == 5  # one WordPiece per Han character
    assert tokenizer.count("退保 " * 600) > zh_embedder.max_tokens  # counted, not truncated


async def test_sync_and_search_with_the_onnx_embedder(database_url: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "退保.md").write_text("# 退保\n\n退保要扣除手续费，第一年最高，之后逐年降低。\n")
    (corpus / "车险.md").write_text("# 车险\n\n交强险是国家规定必须购买的汽车保险。\n")
    (corpus / "life.md").write_text("# Life insurance\n\nA death benefit is paid to the beneficiary.\n")
    embedding = EmbeddingSettings(provider="onnx", model_dir=MODEL_DIR)
    async with private_database(database_url) as dsn, open_runtime(Settings(embedding=embedding), dsn) as runtime:
        report = await runtime.pipeline().sync(FolderConnector(corpus))
        assert report.ok, report.failures
        response = await runtime.retriever.search(
            SearchRequest(
                query="提前解约会损失多少钱",  # shares no word with the answer: only the vector leg finds it
                filters=SearchFilters(connection_ids=[FolderConnector(corpus).connection_id]),
            )
        )
    assert response.embedding_space == "bge-small-zh-v1.5-512"
    assert response.results[0].source == "退保.md"
    assert response.results[0].vector_rank == 1
