"""Stage-level retries on a real PostgreSQL (and Kafka for the services' wiring): a transient
failure that heals within the attempts is indexed with its retry count, one that does not is
recorded (and dead-lettered) with its count, a permanent one is not retried, and the connection's
``sync_error`` summarises what did not index."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from ragstream.api.http import create_app
from ragstream.api.syncs import sync_router
from ragstream.connectors.folder import FolderConnector
from ragstream.credentials import CredentialCipher
from ragstream.embedding.base import EmbeddingError, TextKind, Vectors
from ragstream.failures import StageFailure, StageRetry, classify, record_failure, record_retry
from ragstream.kafka import create_broker, dead_letters, ensure_topics
from ragstream.messages import ChunkPayload, DocumentHeader, Topic
from ragstream.parsing import ParseError, ParseErrorCode
from ragstream.pipeline import EmbeddedPipeline
from ragstream.runtime import Runtime
from ragstream.service import ServiceContext
from ragstream.settings import StageRetrySettings
from ragstream.stages.embed import EmbedService
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.downstream import Downstream, DownstreamStore
from ragstream.storage.runs import RunStore

pytestmark = pytest.mark.integration

_FAST = StageRetry(attempts=3, backoff_s=0.01, backoff_max_s=0.05)


class ScriptedEmbedder:
    """The runtime's model, except for texts naming a fault: ``healing`` is unavailable for its
    first two calls, ``outage`` always, and ``rejected`` is refused as the provider refuses bad input."""

    def __init__(self, runtime: Runtime) -> None:
        self._inner = runtime.embedder
        self.model_key, self.dimension = runtime.embedder.model_key, runtime.embedder.dimension
        self.calls: Counter[str] = Counter()

    async def warm_up(self) -> None:
        await self._inner.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        for fault in ("healing", "outage", "rejected"):
            if any(fault in text for text in texts):
                self.calls[fault] += 1
                if fault == "rejected":
                    raise EmbeddingError("input rejected (400)", retryable=False, provider="test")
                if fault == "outage" or self.calls[fault] <= 2:
                    raise EmbeddingError("provider unavailable (503)", retryable=True, provider="test")
        return await self._inner.embed(texts, kind)

    async def aclose(self) -> None:
        """The inner embedder belongs to the runtime."""


async def ready() -> bool:
    return True


async def test_transient_failures_are_retried_and_the_connection_summarises_the_rest(
    runtime: Runtime, tmp_path: Path
) -> None:
    for n in range(3):
        (tmp_path / f"steady-{n}.md").write_text(f"# Steady {n}\n\nA steady page {n} about canals.\n")
    (tmp_path / "healing.md").write_text("# Healing\n\nThe healing page comes back after two tries.\n")
    (tmp_path / "outage.md").write_text("# Outage\n\nThe outage page never gets a vector.\n")
    (tmp_path / "rejected.md").write_text("# Rejected\n\nThe rejected page is refused by the provider.\n")
    (tmp_path / "empty.md").write_text("   \n")
    embedder = ScriptedEmbedder(runtime)
    pipeline = EmbeddedPipeline(
        runtime.store,
        runtime.chunker,
        EmbedService(embedder),
        runtime.indexer,
        max_document_bytes=runtime.settings.max_document_bytes,
        retry=_FAST,
    )
    connection = FolderConnector(tmp_path).connection_id
    runs = RunStore(runtime.pool, runtime.dsn)
    try:
        report = await pipeline.sync(FolderConnector(tmp_path))

        assert report.progress.indexed == 4  # the steady pages and the healed one
        retries = {
            row["source"]: row["retry_count"]
            for row in await runtime.pool.fetch(
                "SELECT source, retry_count FROM documents WHERE connection_id = $1", connection
            )
        }
        assert retries == {"steady-0.md": 0, "steady-1.md": 0, "steady-2.md": 0, "healing.md": 2}
        failures = {failure.source: (failure.code, failure.retry_count) for failure in report.failures}
        assert failures == {
            "outage.md": ("embedding_unavailable", 2),  # three attempts, two of them retries
            "rejected.md": ("embedding_rejected", 0),
            "empty.md": ("empty", 0),
        }
        assert embedder.calls == Counter(healing=3, outage=3, rejected=1)

        summary = "3 documents failed: 1 embedding_rejected, 1 embedding_unavailable, 1 empty"
        app = create_app(lambda: runtime.retriever, ready=ready, routers=[sync_router(lambda: runs)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            status = (await client.get(f"/v1/connections/{connection}/status")).json()
        assert status["sync_error"] == summary
        [line] = [line for line in await runs.overview() if line.connection_id == connection]
        assert line.sync_error == summary  # what ragstream status prints as the last error
        listed = await ConnectionStore(runtime.pool, CredentialCipher([])).get(connection)
        assert listed is not None and listed.sync_error == summary

        # The page is changed at the source so that it embeds: the next sync indexes it, and the
        # summary no longer counts it.
        (tmp_path / "outage.md").write_text("# Back\n\nThe page embeds again.\n")
        await pipeline.sync(FolderConnector(tmp_path))
        assert await runs.sync_error(connection) == "2 documents failed: 1 embedding_rejected, 1 empty"
    finally:
        await runs.aclose()
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection)


def _header(connection_id: str, name: str) -> DocumentHeader:
    return DocumentHeader(
        document_id=uuid.uuid4().hex,
        connection_id=connection_id,
        external_id=name,
        version=1_000_000 + len(name),
        content_hash="0" * 64,
        title=name,
        source=name,
        media_type="text/markdown",
    )


def _failing(times: int, error: Exception, calls: list[str], name: str) -> Callable[[], Awaitable[list[BaseModel]]]:
    """A lambda returning a coroutine, as the service handlers pass their stage's ``run``."""

    async def produce() -> list[BaseModel]:
        calls.append(name)
        if calls.count(name) <= times:
            raise error
        return []

    return lambda: produce()


@pytest.mark.kafka
async def test_a_kafka_stage_retries_before_it_dead_letters(runtime: Runtime, kafka_bootstrap: str) -> None:
    """The services' shared ``ServiceContext.process``: the same policy, with the dead letter
    carrying the retry count."""
    settings = runtime.settings.model_copy(
        update={"stage_retry": StageRetrySettings(attempts=3, backoff_s=0.01, backoff_max_s=0.05)}
    )
    connection = f"retries-{uuid.uuid4().hex[:8]}"
    await runtime.store.ensure_connection(connection, "folder", connection, None)
    await ensure_topics(kafka_bootstrap)
    broker = create_broker(kafka_bootstrap, "embedder")
    await broker.start()
    service = ServiceContext("embedder", replace(runtime, settings=settings), broker)
    unavailable = EmbeddingError("provider unavailable (503)", retryable=True, provider="test")
    calls: list[str] = []
    headers = {name: _header(connection, name) for name in ("healing", "outage", "binary")}
    try:
        for name, times, error in [
            ("healing", 2, unavailable),
            ("outage", 99, unavailable),
            ("binary", 99, ParseError(ParseErrorCode.BINARY, "not text")),
        ]:
            await service.process(
                "embed", Topic.DOC_CHUNKED, headers[name], _failing(times, error, calls, name), Topic.CHUNK_EMBEDDED
            )
        assert Counter(calls) == Counter(healing=3, outage=3, binary=1)
        failures = {
            failure.source: (failure.code, failure.retry_count) for failure in await runtime.store.failures(connection)
        }
        # healing's row stays until the indexer commits that version; it shows its two retries (the
        # second, which succeeded, was announced by the row as under way).
        assert failures == {
            "healing": ("embedding_unavailable", 2),
            "outage": ("embedding_unavailable", 2),
            "binary": ("binary", 0),
        }
        letters = {
            letter.header.source: (letter.code, letter.retry_count)
            async for letter in dead_letters(kafka_bootstrap)
            if letter.header is not None and letter.header.connection_id == connection
        }
        assert letters == {"outage": ("embedding_unavailable", 2), "binary": ("binary", 0)}
    finally:
        await broker.stop()
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection)


async def test_a_run_waits_for_a_document_a_stage_is_still_retrying(runtime: Runtime) -> None:
    """What a Kafka-mode run waits for: a failure still being retried is pending, one given up on
    is failed, and a commit since the run started is indexed."""
    connection = f"settle-{uuid.uuid4().hex[:8]}"
    await runtime.store.ensure_connection(connection, "folder", connection, None)
    runs = RunStore(runtime.pool, runtime.dsn)
    settled = DownstreamStore(runtime.pool)
    header = _header(connection, "retried")
    announced = (header.document_id, header.version)
    unavailable = EmbeddingError("provider unavailable (503)", retryable=True, provider="test")
    try:
        await record_retry(runtime.store, header, "embed", unavailable)
        assert await settled.downstream([announced]) == Downstream(indexed=0, failed=0, chunks=0)
        # Still being retried: not a failed document in the connection's summary either.
        assert await runs.sync_error(connection) is None
        await record_failure(runtime.store, header, "embed", classify(unavailable))
        given_up = await settled.downstream([announced])
        assert given_up == Downstream(indexed=0, failed=1, chunks=0, failed_embedding=1) and given_up.settled(1)
        assert await runs.sync_error(connection) == "1 document failed: 1 embedding_unavailable"
        assert not (await settled.downstream([announced, ("never-announced", 1)])).settled(2)
    finally:
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection)


async def test_a_run_does_not_settle_on_an_older_version_still_in_flight(runtime: Runtime) -> None:
    """A killed earlier run left an older version of the document in flight: it commits (or fails
    for good) after this run began, but only the announced version or a newer one settles the run."""
    connection = f"settle-{uuid.uuid4().hex[:8]}"
    await runtime.store.ensure_connection(connection, "folder", connection, None)
    runs = DownstreamStore(runtime.pool)
    older = _header(connection, "in-flight").model_copy(update={"version": await runtime.store.next_version()})
    announced = older.model_copy(update={"version": await runtime.store.next_version()})
    chunks = [ChunkPayload(ordinal=0, heading="in-flight", text="A page committed by two runs.")]
    vectors = await runtime.embedder.embed([chunks[0].text])
    pending = Downstream(indexed=0, failed=0, chunks=0)
    try:
        await record_failure(runtime.store, older, "parse", StageFailure("binary", "binary", retryable=False))
        assert await runs.downstream([(announced.document_id, announced.version)]) == pending
        await runtime.store.commit_document(older, chunks, vectors, runtime.embedder.model_key)
        assert await runs.downstream([(announced.document_id, announced.version)]) == pending
        await runtime.store.commit_document(announced, chunks, vectors, runtime.embedder.model_key)
        assert await runs.downstream([(announced.document_id, announced.version)]) == Downstream(
            indexed=1, failed=0, chunks=1
        )
    finally:
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection)
