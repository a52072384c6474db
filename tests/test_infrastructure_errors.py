"""A stage that loses PostgreSQL under it redelivers its message instead of failing the document.

Found by the fault campaign (``tests/e2e/test_infrastructure_restarts.py``): a restart of PostgreSQL
terminates every session ("terminating connection due to administrator command", SQLSTATE 57P01),
and a connection cut in the middle of a query can surface as asyncpg's ``InternalClientError``.
Neither says anything about the document; recorded as its failure (``database_error``, or the raw
class name), a server restart would dead-letter every document in flight. ``ServiceContext.process``
must re-raise them, so the message is not acked, and record nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from pydantic import BaseModel

from ragstream.embedding.base import EmbeddingError
from ragstream.kafka import create_broker, dead_letters, ensure_topics
from ragstream.messages import DocumentHeader, Topic
from ragstream.runtime import Runtime
from ragstream.service import ServiceContext

pytestmark = pytest.mark.integration


def _header(connection_id: str) -> DocumentHeader:
    return DocumentHeader(
        document_id=uuid.uuid4().hex,
        connection_id=connection_id,
        external_id="in-flight.md",
        version=2_000_000,
        content_hash="0" * 64,
        title="In flight",
        source="in-flight.md",
        media_type="text/markdown",
    )


async def _process_raising(runtime: Runtime, header: DocumentHeader, error: BaseException) -> None:
    # Never started: an infrastructure error publishes nothing, and a document failure would fail
    # loudly here instead of quietly dead-lettering.
    service = ServiceContext("chunker", runtime, create_broker("127.0.0.1:9", "chunker"))

    async def produce() -> list[BaseModel]:
        raise error

    await service.process("chunk", Topic.DOC_CHANGED, header, produce, Topic.DOC_CHUNKED)


@pytest.fixture
async def connection_id(runtime: Runtime) -> AsyncIterator[str]:
    """A connection of the test's own (failure rows reference it)."""
    connection_id = f"infra-{uuid.uuid4().hex[:8]}"
    await runtime.store.ensure_connection(connection_id, "folder", connection_id, None)
    try:
        yield connection_id
    finally:
        await runtime.pool.execute("DELETE FROM connections WHERE id = $1", connection_id)


async def _failures(runtime: Runtime, connection_id: str) -> int:
    return int(
        await runtime.pool.fetchval("SELECT count(*) FROM document_failures WHERE connection_id = $1", connection_id)
    )


async def test_a_session_terminated_by_the_server_is_redelivered(runtime: Runtime, connection_id: str) -> None:
    """The real thing: the stage's query is cut by ``pg_terminate_backend``, as a restart cuts it."""
    header = _header(connection_id)
    victim = await asyncpg.connect(runtime.dsn)
    try:
        pid = await victim.fetchval("SELECT pg_backend_pid()")

        async def terminate_soon() -> None:
            await asyncio.sleep(0.3)
            await runtime.pool.execute("SELECT pg_terminate_backend($1)", pid)

        service = ServiceContext("chunker", runtime, create_broker("127.0.0.1:9", "chunker"))

        async def produce() -> list[BaseModel]:
            await victim.execute("SELECT pg_sleep(30)")
            return []

        killer = asyncio.create_task(terminate_soon())
        # asyncpg reports the cut as the server's 57P01 or as the closed connection, by timing.
        with pytest.raises((asyncpg.AdminShutdownError, asyncpg.ConnectionDoesNotExistError)):
            await service.process("chunk", Topic.DOC_CHANGED, header, produce, Topic.DOC_CHUNKED)
        await killer
    finally:
        await victim.close()
    assert await _failures(runtime, connection_id) == 0


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.CrashShutdownError("terminating connection because of crash of another server process"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    ],
    ids=lambda error: type(error).__name__,
)
async def test_a_lost_database_is_not_the_documents_failure(
    runtime: Runtime, connection_id: str, error: Exception
) -> None:
    with pytest.raises(type(error)):
        await _process_raising(runtime, _header(connection_id), error)
    assert await _failures(runtime, connection_id) == 0


@pytest.mark.kafka
async def test_a_failure_of_a_deleted_connections_document_is_dead_lettered_not_looped(
    runtime: Runtime, kafka_bootstrap: str
) -> None:
    """A connection deleted while its documents are in flight: the failure row has nothing to hang
    on (its foreign key), which must not make the message redeliver forever; the dead letter goes."""
    header = _header(f"deleted-{uuid.uuid4().hex[:8]}")
    await ensure_topics(kafka_bootstrap)
    broker = create_broker(kafka_bootstrap, "embedder")
    await broker.start()
    try:
        service = ServiceContext("embedder", runtime, broker)

        async def produce() -> list[BaseModel]:
            raise EmbeddingError("input rejected (400)", retryable=False, provider="test")

        await service.process("embed", Topic.DOC_CHUNKED, header, produce, Topic.CHUNK_EMBEDDED)
    finally:
        await broker.stop()
    letters = [
        letter
        async for letter in dead_letters(kafka_bootstrap)
        if letter.header is not None and letter.header.document_id == header.document_id
    ]
    assert [(letter.step, letter.code) for letter in letters] == [("embed", "embedding_rejected")]
