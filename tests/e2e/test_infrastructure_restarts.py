"""The Kafka pipeline survives its infrastructure restarting mid-sync (issue 11, the fault campaign).

Two faults, each during a sync of a few hundred documents through the real service processes:

* the Kafka broker (a private one, ``ragstream.local_kafka``) is SIGKILLed once about a third of
  the documents are indexed, and restarted on the same port and storage a few seconds later;
* PostgreSQL (a private ``EmbeddedPostgres``) is restarted at the same point (a fast shutdown, as
  for maintenance or a failover: every session is terminated by the administrator), and later, with
  the stages still at work, its postmaster is SIGKILLed; each time it is started again on its port.

The services stay up throughout (none may exit); the sync completes, or, when the fault failed it,
a sync started again once the infrastructure is back completes. Once every stage group has committed
to the end of its topics, the index must equal a clean run's (the embedded pipeline on the same
files): the same documents with the same chunks (ordinal, heading, text), no duplicate chunk, one
vector per chunk, nothing left in ``pending_batches``, no failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.kafka import ensure_topics
from ragstream.local_kafka import KafkaNode
from ragstream.storage.database import connect_pool
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from tests.support.connections import private_database
from tests.support.fake_dashscope import run_fake_dashscope
from tests.support.pipeline import (
    KafkaLag,
    Pipeline,
    assert_same_index,
    clean_run,
    count,
    indexed_documents,
    service_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.usefixtures("private_networks")]

DOCUMENTS = 160
DIMENSION = 64
# The fault strikes once this fraction of the documents is indexed, or this fraction is listed,
# whichever comes first: while the fetcher is still announcing if the machine is slow.
FAULT_AT = 0.3
LISTED_AT = 0.6
DOWN_S = 3.0  # how long the infrastructure stays down
SETTLE_TIMEOUT_S = 240.0
EMBED_DELAY_S = 0.5  # per request of the fake DashScope during the faulty run


def write_corpus(folder: Path, documents: int) -> None:
    """Small Markdown notes; every 8th has several sections and so several chunks and batches."""
    for number in range(documents):
        path = folder / f"part{number % 6}" / f"note{number:03}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        if number % 8 == 3:
            sections = "".join(
                f"\n## Part {part}\n\n" + f"Guide {number} step {part} turns valve {part + 1}. " * 25 + "\n"
                for part in range(3 + number % 3)
            )
            path.write_text(f"# Guide {number}\n{sections}")
        else:
            path.write_text(f"# Note {number}\n\nNote {number} keeps the widget in bay {number % 37}.\n")


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[KafkaNode]:
    """A broker of this test's own: killing it must not touch the session's."""
    node = KafkaNode(tmp_path / "kafka")
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def private_postgres() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL server of this test's own (in /tmp, reachable by the account it runs as)."""
    data_dir = Path(tempfile.mkdtemp(prefix="ragstream-restart-pg-"))
    server = EmbeddedPostgres(data_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def stop_postmaster(server: EmbeddedPostgres, how: signal.Signals) -> None:
    """Signal the postmaster and wait until it is gone: SIGINT is PostgreSQL's fast shutdown (each
    session is told "terminating connection due to administrator command"), SIGKILL a crash."""
    pid = int((server.data_dir / "postmaster.pid").read_text().splitlines()[0])
    os.kill(pid, how)
    deadline = time.monotonic() + 60
    while server.alive():
        assert time.monotonic() < deadline, f"the postmaster outlived {how.name}"
        time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class Fault:
    """``strike`` once ``at`` of the documents are indexed (or, for the first fault, ``LISTED_AT``
    listed), stay down ``DOWN_S``, then ``recover``."""

    name: str
    at: float
    strike: Callable[[], None]
    recover: Callable[[], None]


async def sync_through_faults(
    pipeline: Pipeline, dsn: str, bootstrap: str, folder: Path, faults: list[Fault]
) -> dict[str, object]:
    """Sync ``folder`` while the faults strike in turn; start the sync again whenever one ends failed;
    return once a sync is ready and the stage groups are drained. Reports what happened: syncs
    started and failed, and where each fault struck."""
    connection_id = FolderConnector(folder).connection_id
    started = time.monotonic()
    happened: dict[str, object] = {}
    pending = list(faults)
    syncs = failed_syncs = 0
    async with KafkaLag(bootstrap) as lag:
        sync_wanted = True
        while True:
            assert time.monotonic() - started < SETTLE_TIMEOUT_S, f"not settled:\n{pipeline.tails()}"
            assert pipeline.exited() == {}, pipeline.tails()
            if sync_wanted:
                code = await asyncio.to_thread(pipeline.trigger_sync, folder)
                if code == 202:
                    syncs += 1
                    sync_wanted = False
                else:  # the fetcher cannot start it right now (its database is coming back): try again
                    assert code in (0, 409, 500, 503), code
                    sync_wanted = code != 409
            status = await asyncio.to_thread(pipeline.sync_state, folder)
            if status is not None and status["state"] == "failed" and not sync_wanted:
                failed_syncs += 1
                sync_wanted = True
            if pending:
                fault = pending[0]
                indexed = await _indexed(dsn, connection_id)
                listed = listed_by(status) if len(pending) == len(faults) else 0
                if indexed is not None and (indexed >= fault.at * DOCUMENTS or listed >= LISTED_AT * DOCUMENTS):
                    # In the middle of it: the fetcher still announcing or the stages still indexing.
                    assert indexed < DOCUMENTS, f"{fault.name} came too late: everything is indexed"
                    happened[fault.name] = f"at {listed} listed, {indexed} indexed"
                    fault.strike()
                    await asyncio.sleep(DOWN_S)
                    await asyncio.to_thread(fault.recover)
                    pending.pop(0)
            elif status is not None and status["state"] == "ready" and not sync_wanted:
                try:
                    if await lag.drained():
                        return happened | {"syncs": syncs, "failed_syncs": failed_syncs}
                except Exception:  # the broker is still electing leaders after its restart
                    pass
            await asyncio.sleep(0.5)


def listed_by(status: dict[str, object] | None) -> int:
    """How many items the sync has listed at the source so far."""
    counts = status["counts"] if status is not None else {}
    return int(counts.get("seen", 0)) if isinstance(counts, dict) else 0


async def _indexed(dsn: str, connection_id: str) -> int | None:
    """Documents indexed so far (None while the database cannot be reached)."""
    try:
        connection = await asyncpg.connect(dsn, timeout=5)
    except (OSError, asyncpg.PostgresError):
        return None
    try:
        query = "SELECT count(*) FROM documents WHERE connection_id = $1 AND status = 'indexed'"
        return int(await connection.fetchval(query, connection_id))
    finally:
        await connection.close()


async def run_campaign(dsn: str, bootstrap: str, tmp_path: Path, faults: list[Fault], name: str) -> None:
    started = time.monotonic()
    folder, clean_folder, logs = tmp_path / "corpus", tmp_path / "clean", tmp_path / "logs"
    write_corpus(folder, DOCUMENTS)
    shutil.copytree(folder, clean_folder)
    logs.mkdir()
    connection_id = FolderConnector(folder).connection_id
    await ensure_topics(bootstrap)
    with run_fake_dashscope() as fake:
        clean = await clean_run(clean_folder, dsn, fake, DIMENSION)
        assert len(clean) == DOCUMENTS
        # The faulty run's embedder answers slowly, so that each fault strikes while documents are
        # still in flight, however many documents the embedder stage puts in one request.
        fake.delay_s = EMBED_DELAY_S
        env = {**service_env(dsn, bootstrap, fake, tmp_path, DIMENSION), "RAGSTREAM_CHUNK_BATCH_CHUNKS": "2"}
        pipeline = Pipeline(env, logs).start()
        try:
            happened = await sync_through_faults(pipeline, dsn, bootstrap, folder, faults)
        finally:
            pipeline.stop()
    pool = await connect_pool(dsn)
    try:
        faulty = await indexed_documents(pool, connection_id)
        chunk_rows = await count(
            pool,
            "SELECT count(*) FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1",
            connection_id,
        )
        await assert_same_index(pool, connection_id, faulty, clean, chunk_rows, DIMENSION)
    finally:
        await pool.close()
    print(f"\n{name}: {DOCUMENTS} documents, {chunk_rows} chunks, {happened}, {time.monotonic() - started:.0f} s")


async def test_broker_killed_and_restarted_during_a_sync(
    private_kafka: KafkaNode, database_url: str, tmp_path: Path
) -> None:
    crash = Fault("broker SIGKILL", FAULT_AT, private_kafka.kill, private_kafka.restart)
    async with private_database(database_url) as dsn:
        await run_campaign(dsn, private_kafka.bootstrap_servers, tmp_path, [crash], "broker restart")


async def test_postgres_restarted_and_killed_during_a_sync(
    private_postgres: EmbeddedPostgres, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A restart first (fast shutdown: every session is terminated by the administrator), then a
    crash (the postmaster SIGKILLed) while the stages are still at work."""

    def stop(how: signal.Signals) -> Callable[[], None]:
        return lambda: stop_postmaster(private_postgres, how)

    faults = [
        Fault("fast restart", FAULT_AT, stop(signal.SIGINT), private_postgres.restart),
        Fault("SIGKILL", 0.7, stop(signal.SIGKILL), private_postgres.restart),
    ]
    await run_campaign(private_postgres.dsn, kafka_bootstrap, tmp_path, faults, "postgres restarts")
