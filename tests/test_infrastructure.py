"""The real services the suite depends on work: pgvector with HNSW, and Kafka."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]

from ragstream.storage.embedded_postgres import EmbeddedPostgres


@pytest.mark.integration
async def test_pgvector_hnsw_nearest_neighbours(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        version = await connection.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        assert version, "the vector extension is not installed"
        # A temporary table leaves nothing behind on a shared $DATABASE_URL.
        await connection.execute("CREATE TEMP TABLE items (id int PRIMARY KEY, embedding vector(3))")
        await connection.execute("CREATE INDEX items_hnsw ON items USING hnsw (embedding vector_cosine_ops)")
        await connection.executemany(
            "INSERT INTO items VALUES ($1, $2::text::vector)",
            [(1, "[1,0,0]"), (2, "[0,1,0]"), (3, "[0.9,0.1,0]"), (4, "[0,0,1]")],
        )
        await connection.execute("SET enable_seqscan = off")  # force the HNSW index
        query = "SELECT id FROM items ORDER BY embedding <=> $1::text::vector LIMIT 2"
        plan = await connection.fetch(f"EXPLAIN {query}", "[1,0.05,0]")
        assert "items_hnsw" in "\n".join(row[0] for row in plan)
        rows = await connection.fetch(query, "[1,0.05,0]")
        assert [row["id"] for row in rows] == [1, 3]
    finally:
        await connection.close()


@pytest.mark.kafka
async def test_kafka_produce_and_consume(kafka_bootstrap: str) -> None:
    topic = f"infra-{uuid.uuid4().hex}"  # auto-created with the broker defaults
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"hello", key=b"doc-1")
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=f"infra-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        session_timeout_ms=2000,  # group joins cost about half of it
        heartbeat_interval_ms=500,
    )
    await consumer.start()
    try:
        message = await asyncio.wait_for(consumer.getone(), timeout=30)
        partitions = consumer.partitions_for_topic(topic)
    finally:
        await consumer.stop()
    assert (message.key, message.value) == (b"doc-1", b"hello")
    assert partitions == {0, 1, 2}  # num.partitions=3


def test_a_private_data_dir_still_gets_a_cluster_the_server_account_can_reach() -> None:
    private = Path(tempfile.mkdtemp(prefix="ragstream-private-"))  # mode 0700, like /root
    try:
        server = EmbeddedPostgres(private / "postgres")
        # Root runs the server as an unprivileged account, which cannot enter a 0700 folder.
        expected = Path("/var/lib/ragstream/clusters") if os.geteuid() == 0 else private
        assert server.data_dir.parent == expected
        with server:
            assert server.dsn.startswith("postgresql://")
    finally:
        shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
