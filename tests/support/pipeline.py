"""The Kafka pipeline as real service processes for end-to-end tests: environment, sync, drain, compare.

``Pipeline`` starts the fetcher and the three consumers (``tests.support.services``), triggers a
folder sync over the fetcher's API and waits for it; ``KafkaLag`` says when every stage group has
committed to the end of its topics; ``indexed_documents`` is what the index answers for a
connection, the unit the fault tests compare with a clean run.
"""

from __future__ import annotations

import time
from pathlib import Path

import asyncpg
import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import SecretStr

from ragstream.connectors.folder import FolderConnector
from ragstream.messages import Topic
from ragstream.runtime import open_runtime
from ragstream.settings import EmbeddingSettings, Settings
from tests.support.fake_dashscope import FakeDashScope
from tests.support.services import ServiceProcess

__all__ = [
    "CONSUMED",
    "CONSUMERS",
    "FETCHER",
    "Chunk",
    "IndexedDocument",
    "KafkaLag",
    "Pipeline",
    "assert_same_index",
    "clean_run",
    "count",
    "embedding_settings",
    "indexed_documents",
    "service_env",
]

FETCHER = "connector-fetcher"
CONSUMERS = ("chunker", "embedder", "indexer")
# What each consumer group reads; checked upstream first (see ``KafkaLag.drained``).
CONSUMED: tuple[tuple[str, tuple[Topic, ...]], ...] = (
    ("chunker", (Topic.DOC_CHANGED,)),
    ("embedder", (Topic.DOC_CHUNKED,)),
    ("indexer", (Topic.CHUNK_EMBEDDED, Topic.DOC_DELETED)),
)

# One chunk as the index answers it: (ordinal, heading, text). A document: (title, its chunks).
Chunk = tuple[int, str, str]
IndexedDocument = tuple[str, tuple[Chunk, ...]]


def service_env(
    database_url: str, kafka_bootstrap: str, fake: FakeDashScope, folder_roots: Path, dimension: int
) -> dict[str, str]:
    """The services' environment: the fake DashScope as their embedder (delivery is under test, not
    the model), short consumer-group sessions, no timer, folders under ``folder_roots``."""
    return {
        "DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "RAGSTREAM_KAFKA_SESSION_TIMEOUT_MS": "6000",
        "RAGSTREAM_FETCHER_INTERVAL_S": "0",
        "RAGSTREAM_EMBEDDER_PROVIDER": "dashscope",
        "RAGSTREAM_EMBEDDER_BASE_URL": fake.base_url,
        "RAGSTREAM_EMBEDDER_API_KEY": fake.api_key,
        "RAGSTREAM_EMBEDDER_DIMENSION": str(dimension),
        "RAGSTREAM_ALLOW_PRIVATE_NETWORKS": "true",
        "RAGSTREAM_FOLDER_ROOTS": str(folder_roots),
    }


class Pipeline:
    """The fetcher and one replica of each consumer, as processes; ``stop()`` ends them all."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.services: dict[str, ServiceProcess] = {}

    def start(self, timeout: float = 120.0) -> Pipeline:
        for name in (*CONSUMERS, FETCHER):
            self.services[name] = ServiceProcess(name, self.env, self.logs).start(wait_ready=False)
        for process in self.services.values():
            process.wait_ready(timeout)
        return self

    def stop(self) -> None:
        for process in self.services.values():
            process.stop()

    @property
    def fetcher(self) -> ServiceProcess:
        return self.services[FETCHER]

    def exited(self) -> dict[str, int]:
        """The services that are no longer running, with their exit codes."""
        return {
            name: code
            for name, process in self.services.items()
            if process.process is not None and (code := process.process.poll()) is not None
        }

    def trigger_sync(self, folder: Path) -> int:
        """POST the sync; the status code (202 started, 409 one is running), or 0 when the request
        failed (the fetcher is busy or cannot reach its database right now)."""
        try:
            response = httpx.post(f"{self.fetcher.url}/v1/syncs", json={"path": str(folder)}, timeout=30)
        except httpx.HTTPError:
            return 0
        return response.status_code

    def sync_state(self, folder: Path) -> dict[str, object] | None:
        """The fetcher's latest sync of the folder (None: none yet, or no answer right now)."""
        try:
            response = httpx.get(f"{self.fetcher.url}/v1/syncs/{FolderConnector(folder).connection_id}", timeout=10)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        status: dict[str, object] = response.json()
        return status

    def sync(self, folder: Path, timeout: float = 120.0) -> dict[str, object]:
        """Start a sync and wait until it is no longer syncing; returns its last status."""
        assert self.trigger_sync(folder) == 202
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.sync_state(folder)
            if status is not None and status["state"] != "syncing":
                return status
            time.sleep(0.3)
        raise TimeoutError(f"the sync did not end within {timeout} s:\n{self.tails()}")

    def tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {name}\n{process.tail(lines)}" for name, process in self.services.items())


class KafkaLag:
    """Committed offsets of the stage groups against the topics' end offsets."""

    def __init__(self, bootstrap: str) -> None:
        self._admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        self._consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self._partitions: dict[Topic, list[TopicPartition]] = {}

    async def __aenter__(self) -> KafkaLag:
        await self._admin.start()
        await self._consumer.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._consumer.stop()
        await self._admin.close()

    async def partitions(self, topic: Topic) -> list[TopicPartition]:
        if topic not in self._partitions:
            described = await self._admin.describe_topics([topic.value])
            self._partitions[topic] = [
                TopicPartition(topic.value, entry["partition"]) for entry in described[0]["partitions"]
            ]
            assert self._partitions[topic], f"{topic} has no partitions"
        return self._partitions[topic]

    async def end(self, topic: Topic) -> int:
        """How many messages ``topic`` has had: the sum of its partitions' end offsets."""
        return sum((await self._consumer.end_offsets(await self.partitions(topic))).values())

    async def committed(self, group: str, topics: tuple[Topic, ...]) -> dict[TopicPartition, int]:
        """The group's committed offset per partition (-1: nothing committed)."""
        partitions = [partition for topic in topics for partition in await self.partitions(topic)]
        offsets = await self._admin.list_consumer_group_offsets(group, partitions=partitions)
        return {
            partition: (offset.offset if (offset := offsets.get(partition)) is not None else -1)
            for partition in partitions
        }

    async def behind(self, group: str, topics: tuple[Topic, ...]) -> int:
        committed = await self.committed(group, topics)
        partitions = list(committed)
        first = await self._consumer.beginning_offsets(partitions)
        ends = await self._consumer.end_offsets(partitions)
        return sum(
            max(0, ends[partition] - (offset if offset >= 0 else first[partition]))
            for partition, offset in committed.items()
        )

    async def drained(self) -> bool:
        """True when every stage group has committed everything. Checked upstream first: a stage
        commits an offset only after its outputs are acknowledged, so once the chunker is at the
        end, everything it will ever publish is already within the embedder's end offsets, and so on."""
        for stage, topics in CONSUMED:
            if await self.behind(f"ragstream-{stage}", topics):
                return False
        return True


async def indexed_documents(pool: asyncpg.Pool, connection_id: str) -> dict[str, IndexedDocument]:
    """What the index answers for a connection: per source its title and ordered chunks."""
    rows = await pool.fetch(
        "SELECT d.source, d.title, c.ordinal, c.heading, c.text FROM documents d"
        " LEFT JOIN chunks c ON c.document_id = d.id"
        " WHERE d.connection_id = $1 AND d.status = 'indexed' ORDER BY d.source, c.ordinal",
        connection_id,
    )
    titles: dict[str, str] = {}
    chunks: dict[str, list[Chunk]] = {}
    for row in rows:
        titles[row["source"]] = row["title"]
        listed = chunks.setdefault(row["source"], [])
        if row["ordinal"] is not None:
            listed.append((row["ordinal"], row["heading"], row["text"]))
    return {source: (titles[source], tuple(chunks[source])) for source in titles}


def embedding_settings(fake: FakeDashScope, dimension: int) -> EmbeddingSettings:
    return EmbeddingSettings(
        provider="dashscope", base_url=fake.base_url, api_key=SecretStr(fake.api_key), dimension=dimension
    )


async def clean_run(folder: Path, database_url: str, fake: FakeDashScope, dimension: int) -> dict[str, IndexedDocument]:
    """The expected index: a fault-free sync of ``folder`` by the embedded pipeline (same stages, no Kafka)."""
    settings = Settings(database_url=database_url, embedding=embedding_settings(fake, dimension))
    async with open_runtime(settings, database_url) as runtime:
        report = await runtime.pipeline().sync(FolderConnector(folder))
        assert report.ok, report.failures[:5]
        return await indexed_documents(runtime.pool, FolderConnector(folder).connection_id)


async def count(pool: asyncpg.Pool, query: str, *args: object) -> int:
    return int(await pool.fetchval(query, *args))


async def assert_same_index(
    pool: asyncpg.Pool,
    connection_id: str,
    faulty: dict[str, IndexedDocument],
    clean: dict[str, IndexedDocument],
    chunk_rows: int,
    dimension: int,
) -> None:
    """The faulty run's index is the clean run's, and its bookkeeping is consistent."""
    assert set(faulty) == set(clean), (
        f"missing {sorted(set(clean) - set(faulty))[:10]}, unexpected {sorted(set(faulty) - set(clean))[:10]}"
    )
    different = [source for source in clean if faulty[source] != clean[source]]
    assert not different, f"{len(different)} documents differ from the clean run, e.g. {different[:5]}"
    assert chunk_rows == sum(len(chunks) for _, chunks in clean.values())
    in_connection = "FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1"
    distinct = await count(pool, f"SELECT count(DISTINCT (c.document_id, c.ordinal)) {in_connection}", connection_id)
    assert chunk_rows == distinct, "duplicate (document, ordinal)"
    counted = await count(
        pool,
        "SELECT coalesce(sum(chunk_count), 0) FROM documents WHERE connection_id = $1 AND status = 'indexed'",
        connection_id,
    )
    assert chunk_rows == counted, "documents.chunk_count disagrees with the chunks table"
    table = await pool.fetchval(
        "SELECT table_name FROM embedding_spaces WHERE model_key = $1", f"dashscope-text-embedding-v3-{dimension}"
    )
    assert table is not None
    embedded = await count(
        pool,
        f"SELECT count(*) {in_connection} AND (SELECT count(*) FROM {table} e WHERE e.chunk_id = c.id) = 1",
        connection_id,
    )
    assert embedded == chunk_rows, f"{chunk_rows - embedded} chunks without exactly one embedding"
    leftover = await count(
        pool,
        "SELECT count(*) FROM pending_batches WHERE document_id IN (SELECT id FROM documents WHERE connection_id = $1)",
        connection_id,
    )
    assert leftover == 0, f"{leftover} batches left in pending_batches"
    failures = await pool.fetch(
        "SELECT source, step, code, message FROM document_failures WHERE connection_id = $1", connection_id
    )
    assert not failures, [dict(row) for row in failures[:5]]
