"""Poison and unknown-schema messages through real Kafka, PostgreSQL and the service processes.

Before a sync, every partition of every consumed topic (``doc.changed``, ``doc.chunked``,
``chunk.embedded``, ``doc.deleted``) gets undecodable bytes and valid JSON of the wrong shape. Each
must come back as a dead letter naming its topic, partition and offset with the reason, the
consumer groups must commit past it, no service may exit, and the good messages behind it on the
same partitions (the sync's documents, then a deletion) must be processed. Then a newer producer
announces a document version with ``schema_version`` 2: it is dead-lettered as
``unsupported_schema_version``, recorded failed on the document (so not indexed), and replaying the
failures later re-drives it to the index.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from ragstream.connectors.folder import FolderConnector
from ragstream.kafka import dead_letters, ensure_topics
from ragstream.messages import SCHEMA_VERSION, DeadLetter, DocumentChanged, DocumentHeader, Topic
from ragstream.poison import PoisonCode
from ragstream.storage.database import connect_pool
from ragstream.storage.documents import DocumentStore
from tests.support.connections import private_database
from tests.support.fake_dashscope import run_fake_dashscope
from tests.support.pipeline import CONSUMED, KafkaLag, Pipeline, indexed_documents, service_env

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.usefixtures("private_networks")]

DIMENSION = 64
POISONS = {
    PoisonCode.UNDECODABLE: b"\xff\xfe\x00 not JSON at all \x9c",
    PoisonCode.INVALID: json.dumps({"kind": "changed", "hello": "a wrong shape"}).encode(),
}
# Where the poison was written: (topic, partition, offset) -> the code it must be dead-lettered with.
Placed = dict[tuple[str, int, int], PoisonCode]


async def place_poison(bootstrap: str, lag: KafkaLag) -> tuple[Placed, dict[tuple[str, int, int], bytes]]:
    """Both poisons on every partition of every consumed topic, before any good message of the test."""
    placed: Placed = {}
    payloads: dict[tuple[str, int, int], bytes] = {}
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for _, topics in CONSUMED:
            for topic in topics:
                for partition in await lag.partitions(topic):
                    for code, value in POISONS.items():
                        sent = await producer.send_and_wait(
                            topic.value, value, key=b"poison", partition=partition.partition
                        )
                        placed[(topic.value, sent.partition, sent.offset)] = code
                        payloads[(topic.value, sent.partition, sent.offset)] = value
        # And one on the dead-letter topic itself: reading the letters back must step over it.
        await producer.send_and_wait(Topic.DEAD_LETTER.value, b"\x00 not a dead letter", key=b"poison")
    finally:
        await producer.stop()
    return placed, payloads


async def letters_for(bootstrap: str, wanted: set[tuple[str, int, int]]) -> dict[tuple[str, int, int], DeadLetter]:
    found: dict[tuple[str, int, int], DeadLetter] = {}
    async for letter in dead_letters(bootstrap):
        if letter.origin is not None:
            where = (letter.origin.topic, letter.origin.partition, letter.origin.offset)
            if where in wanted:
                found[where] = letter
    return found


async def wait_for(condition: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)


async def test_poison_messages_are_dead_lettered_and_the_partitions_move_on(
    database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    folder = tmp_path / "kb"
    folder.mkdir()
    sources = {f"doc{number}.md" for number in range(9)}
    for number in range(9):
        (folder / f"doc{number}.md").write_text(f"# Doc {number}\n\nPoisonproof term{number} lives here.\n")
    connection_id = FolderConnector(folder).connection_id
    logs = tmp_path / "logs"
    logs.mkdir()

    async with private_database(database_url) as dsn, KafkaLag(kafka_bootstrap) as lag:
        with run_fake_dashscope() as fake:
            pipeline = Pipeline(service_env(dsn, kafka_bootstrap, fake, tmp_path, DIMENSION), logs)
            pool = await connect_pool(dsn)
            try:
                await ensure_topics(kafka_bootstrap)  # as the services do: 3 partitions each
                placed, payloads = await place_poison(kafka_bootstrap, lag)
                pipeline.start()
                status = await asyncio.to_thread(pipeline.sync, folder)
                assert status["state"] == "ready", status
                assert set(await indexed_documents(pool, connection_id)) == sources

                # A deletion: the good message behind the poison on doc.deleted is processed too.
                (folder / "doc0.md").unlink()
                status = await asyncio.to_thread(pipeline.sync, folder)
                assert status["state"] == "ready", status
                assert set(await indexed_documents(pool, connection_id)) == sources - {"doc0.md"}
                await wait_for(lag.drained, 60, "every stage group to commit to the end of its topics")

                letters = await letters_for(kafka_bootstrap, set(placed))
                assert set(letters) == set(placed), f"not dead-lettered: {sorted(set(placed) - set(letters))}"
                for where, letter in letters.items():
                    assert letter.code == placed[where].value
                    assert letter.header is None and not letter.retryable, letter
                    assert letter.message
                    assert letter.origin is not None
                    assert (letter.origin.key, letter.origin.payload) == (b"poison", payloads[where])
                    assert letter.step == {"doc.changed": "chunk", "doc.chunked": "embed"}.get(where[0], "index")
                # The groups committed past every poison offset: no partition is stuck behind one.
                for stage, topics in CONSUMED:
                    committed = await lag.committed(f"ragstream-{stage}", topics)
                    for topic, partition, offset in placed:
                        if (position := committed.get(TopicPartition(topic, partition))) is not None:
                            assert position > offset, (stage, topic, partition, offset, position)
                assert not await pool.fetchval(
                    "SELECT count(*) FROM document_failures WHERE connection_id = $1", connection_id
                )

                await a_newer_schema_waits_for_a_replay(pipeline, pool, kafka_bootstrap, folder, lag)
                assert pipeline.exited() == {}, pipeline.tails()
            finally:
                pipeline.stop()
                await pool.close()
    print(f"\npoison messages: {len(placed)} placed, all dead-lettered; {time.monotonic() - started:.0f} s")


async def a_newer_schema_waits_for_a_replay(
    pipeline: Pipeline, pool: asyncpg.Pool, bootstrap: str, folder: Path, lag: KafkaLag
) -> None:
    """A newer producer announces doc1.md's next version in schema 2: dead-lettered with
    ``unsupported_schema_version``, failed on the document, not indexed; a replay indexes it."""
    connection_id = FolderConnector(folder).connection_id
    row = await pool.fetchrow(
        "SELECT id, external_id, title, source, media_type FROM documents WHERE connection_id = $1 AND source = $2",
        connection_id,
        "doc1.md",
    )
    assert row is not None
    content = b"# Doc 1\n\nFrom the future: chronoterm arrives in schema two.\n"
    store = DocumentStore(pool)
    header = DocumentHeader(
        document_id=row["id"],
        connection_id=connection_id,
        external_id=row["external_id"],
        version=await store.next_version(),
        content_hash=hashlib.sha256(content).hexdigest(),
        title=row["title"],
        source=row["source"],
        media_type=row["media_type"],
    )
    await store.stage(header, content)
    newer = {**DocumentChanged(header=header).model_dump(mode="json"), "schema_version": SCHEMA_VERSION + 1}
    # The same from a connection this database does not know: nothing to record it on, still a letter.
    stranger = header.model_copy(update={"connection_id": "folder-unknown", "document_id": "unknown-document"})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        sent = await producer.send_and_wait(
            Topic.DOC_CHANGED.value, json.dumps({**newer, "priority": "high"}).encode(), key=header.document_id.encode()
        )
        strange = await producer.send_and_wait(
            Topic.DOC_CHANGED.value,
            json.dumps({**newer, "header": stranger.model_dump(mode="json")}).encode(),
            key=stranger.document_id.encode(),
        )
    finally:
        await producer.stop()

    async def failed() -> bool:
        query = "SELECT count(*) FROM document_failures WHERE document_id = $1 AND version = $2"
        return bool(await pool.fetchval(query, row["id"], header.version))

    await wait_for(failed, 60, "the newer message to be recorded failed")
    failure = await pool.fetchrow(
        "SELECT step, code, retryable FROM document_failures WHERE document_id = $1", row["id"]
    )
    assert dict(failure or {}) == {"step": "chunk", "code": "unsupported_schema_version", "retryable": True}
    await wait_for(lag.drained, 60, "the chunker to commit past the newer message")
    where, strange_where = (
        (Topic.DOC_CHANGED.value, sent.partition, sent.offset),
        (Topic.DOC_CHANGED.value, strange.partition, strange.offset),
    )
    letters = await letters_for(bootstrap, {where, strange_where})
    assert (letters[where].code, letters[where].header, letters[where].retryable) == (
        "unsupported_schema_version",
        header,
        True,
    )
    assert (letters[strange_where].code, letters[strange_where].header) == ("unsupported_schema_version", stranger)
    assert not await pool.fetchval("SELECT count(*) FROM document_failures WHERE document_id = 'unknown-document'")
    # Not processed: the index still holds the version before it.
    indexed = await indexed_documents(pool, connection_id)
    assert "chronoterm" not in " ".join(text for _, _, text in indexed["doc1.md"][1])

    # Later (the consumers understand it now, or the operator accepts the current schema's reading):
    # the failures replay re-drives the staged version, and it is indexed.
    async with httpx.AsyncClient(timeout=60) as client:
        replayed = await client.post(
            f"{pipeline.fetcher.url}/v1/replays", json={"source": "failures", "connection_id": connection_id}
        )
    assert replayed.status_code == 200, replayed.text
    assert replayed.json()["replayed"] == 1

    async def replay_indexed() -> bool:
        chunks = (await indexed_documents(pool, connection_id))["doc1.md"][1]
        return any("chronoterm" in text for _, _, text in chunks)

    await wait_for(replay_indexed, 60, "the replayed version to be indexed")
    assert not await pool.fetchval("SELECT count(*) FROM document_failures WHERE document_id = $1", row["id"])
