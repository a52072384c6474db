"""Session-wide real services: PostgreSQL + pgvector and a single Apache Kafka broker.

``DATABASE_URL`` / ``KAFKA_BOOTSTRAP_SERVERS`` point the suite at existing servers;
otherwise it starts its own (see docs/architecture.md, "Test infrastructure"). A server that
cannot start fails the tests that need it, loudly: integration tests are never skipped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from ragstream.local_kafka import KafkaNode
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings
from ragstream.storage.embedded_postgres import EmbeddedPostgres


def pytest_configure(config: pytest.Config) -> None:
    # The pipeline's tests embed with USE alone, the quickest offline model, whose rankings many of them
    # pin; the default bilingual embedder has its own tests (tests/embedding/test_bilingual.py).
    os.environ.setdefault("RAGSTREAM_EMBEDDER_PROVIDER", "local")
    config.addinivalue_line("markers", "integration: needs PostgreSQL (database_url)")
    config.addinivalue_line("markers", "kafka: needs a Kafka broker (kafka_bootstrap)")


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A PostgreSQL + pgvector URL: ``$DATABASE_URL`` or a private server."""
    if url := os.environ.get("DATABASE_URL"):
        yield url
        return
    # Not pytest's tmp_path: its 0700 parents keep out the account the server runs as
    # when we are root. A fresh folder in /tmp is reachable and is chowned to it.
    data_dir = Path(tempfile.mkdtemp(prefix="ragstream-test-pg-"))
    server = EmbeddedPostgres(data_dir)
    try:
        yield server.start()  # on failure, EmbeddedPostgresError has the server log
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Kafka bootstrap servers: ``$KAFKA_BOOTSTRAP_SERVERS`` or a private broker."""
    if servers := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield servers
        return
    node = KafkaNode(tmp_path_factory.mktemp("kafka"))  # kafka.log stays for debugging
    try:
        yield node.start()  # on failure, KafkaNodeError has the broker log
    finally:
        node.stop()


@pytest.fixture(scope="session")
async def runtime(database_url: str) -> AsyncIterator[Runtime]:
    """The embedded wiring (local embedder) on the test database, shared by the session."""
    async with open_runtime(Settings(database_url=database_url), database_url) as opened:
        yield opened


@pytest.fixture
def private_networks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let outbound requests reach 127.0.0.1, where the fake vendors listen (``ragstream.outbound``
    refuses private addresses by default)."""
    monkeypatch.setenv("RAGSTREAM_ALLOW_PRIVATE_NETWORKS", "true")


@pytest.fixture
def folder_roots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Let folder connections made over the API read the test's own tmp_path (RAGSTREAM_FOLDER_ROOTS)."""
    monkeypatch.setenv("RAGSTREAM_FOLDER_ROOTS", str(tmp_path))
    return tmp_path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """An empty folder a test fills with documents; each test gets its own connection."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    return folder
