"""Fault injection through real Kafka and PostgreSQL (issue 3, "Tests that must exist").

A sync of 2,000 documents runs through the four pipeline services (two replicas of each consumer)
while a seeded schedule SIGKILLs the fetcher, chunker, embedder and indexer at random moments, and
each consumer also dies once at a named crash point (``RAGSTREAM_CRASH_AT``) exactly between its durable output
and its offset commit. Every dead service is restarted; a killed fetcher loses its in-memory sync,
so the sync is triggered again after each fetcher restart, and that alone must heal it. Consumers
get no such help: the sync is never re-triggered for them, so a message a consumer loses shows up
as a missing document instead of being papered over by the fetcher's "announce what is not
committed" healing.

Once the pipeline is quiescent (the last sync finished and every consumer group has committed up
to the end of its topics) the final index must equal a clean run's: the same documents, and per
document the same chunks (ordinal, heading, text), no duplicate, one embedding per chunk, nothing
left in ``pending_batches`` and no failure. Chunk and document ids are not compared: they carry
the version, which legitimately differs between the runs.

The embedder is the DashScope client against the in-process fake (``tests/support/fake_dashscope``):
the local USE model embeds about seven single-chunk messages per second on the shared 2-core build
machine, which would make two passes over 2,000 documents take ten minutes. What is under test is
delivery (offsets, redelivery, versions, batch assembly), not the model. ``RAGSTREAM_CHUNK_BATCH_CHUNKS``
is 2 in the services so that every multi-chunk document is assembled from several messages in
``pending_batches``, the part of the indexer a redelivery can trip over; batching does not change
the final chunks, so the clean run keeps the default.

``RAGSTREAM_FAULT_SEED`` picks another schedule (the default is fixed so CI is reproducible); the
seed, the kills per service and the wall time are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from ragstream.connectors.folder import FolderConnector
from tests.support.connections import private_database
from tests.support.fake_dashscope import run_fake_dashscope
from tests.support.pipeline import (
    CONSUMERS,
    FETCHER,
    KafkaLag,
    assert_same_index,
    clean_run,
    count,
    indexed_documents,
)
from tests.support.services import ServiceProcess

# The fake DashScope listens on 127.0.0.1, for the clean run here as for the services.
pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.usefixtures("private_networks")]

DOCUMENTS = 2000
SEED = int(os.environ.get("RAGSTREAM_FAULT_SEED", "18"))
DIMENSION = 64  # small vectors: the fake and pgvector spend less per chunk; delivery is what is tested
REPLICAS = 2  # per consumer: the stages are latency-bound, and a kill then also moves partitions
CRASH_EXIT = 86  # ragstream.faults.crash_point
QUIESCENCE_TIMEOUT_S = 600.0

_WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel")
_ZH = ("库存", "值班", "报销", "发布", "备份", "巡检", "审批", "采购")


def write_corpus(folder: Path, count: int) -> None:
    """``count`` small Markdown files in 20 sub-folders, deterministic whatever the schedule's seed.

    Most are one chunk; every 10th is Chinese; every 16th has 2-6 sections and about as many chunks
    (several ``doc.chunked`` batches with the services' batch size of 2); every 160th has 14.
    """
    rng = random.Random(20261201)
    for number in range(count):
        path = folder / f"section{number % 20:02}" / f"note{number:04}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        word = rng.choice(_WORDS)
        if number % 10 == 3:
            topic = _ZH[number % len(_ZH)]
            body = f"# 笔记 {number}\n\n## {topic}\n\n第{number}号{topic}记录：{word}零件存放在{number % 37}号仓位。\n"
        elif number % 16 == 5:
            sections = rng.randint(2, 6) if number % 160 != 5 else 14
            parts = [f"# Guide {number}\n"]
            for section in range(sections):
                sentence = (
                    f"Step {section} of guide {number} turns the {rng.choice(_WORDS)} valve {section + 1} times. "
                )
                parts.append(f"\n## Part {section}\n\n" + sentence * rng.randint(18, 30) + "\n")
            body = "".join(parts)
        else:
            body = f"# Note {number}\n\nNote {number} says the {word} widget {number * 7} sits in bay {number % 37}.\n"
        path.write_text(body, encoding="utf-8")


@dataclass
class Incarnation:
    """The current process in one replica slot of a service, and the crash point it is armed with."""

    service: str
    process: ServiceProcess
    crash_point: str | None = None
    ready: bool = False


@dataclass
class Chaos:
    """Runs the replicas, restarts the dead, executes kills; records what happened.

    Slots are named ``service/replica``. Replica 0 of each consumer is armed with its crash point
    until that point has fired once.
    """

    env: dict[str, str]
    logs: Path
    rng: random.Random
    points: dict[str, str]
    running: dict[str, Incarnation] = field(default_factory=dict)
    kills: Counter[str] = field(default_factory=Counter)
    crashes: Counter[str] = field(default_factory=Counter)
    exits: list[str] = field(default_factory=list)

    def start(self, slot: str) -> None:
        service, replica = slot.split("/")
        env = dict(self.env)
        crash_point = self.points.get(service) if replica == "0" and not self.crashes[service] else None
        if crash_point is not None:
            env["RAGSTREAM_CRASH_AT"] = crash_point
            env["RAGSTREAM_CRASH_AFTER"] = str(self.rng.randint(5, 40))
        process = ServiceProcess(service, env, self.logs).start(wait_ready=False)
        self.running[slot] = Incarnation(service, process, crash_point)

    def is_ready(self, slot: str) -> bool:
        incarnation = self.running[slot]
        if not incarnation.ready:
            try:
                incarnation.ready = httpx.get(f"{incarnation.process.url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        return incarnation.ready

    def kill(self, service: str) -> bool:
        """SIGKILL one ready replica of ``service`` (chosen by the seeded generator) and start another
        in its slot; False when none is ready yet (one that is still starting is not worth killing)."""
        ready = [slot for slot, i in self.running.items() if i.service == service and self.is_ready(slot)]
        if not ready:
            return False
        slot = self.rng.choice(ready)
        self.running[slot].process.kill()
        self.kills[service] += 1
        self.exits.append(f"{slot} SIGKILL")
        self.start(slot)
        return True

    def reap(self) -> set[str]:
        """Restart every process that exited on its own (only an armed crash point may do that);
        returns the services restarted."""
        restarted = set()
        for slot, incarnation in list(self.running.items()):
            assert incarnation.process.process is not None
            code = incarnation.process.process.poll()
            if code is None:
                continue
            assert code == CRASH_EXIT and incarnation.crash_point, (
                f"{slot} exited with {code}:\n{incarnation.process.tail()}"
            )
            self.crashes[incarnation.service] += 1
            self.exits.append(f"{slot} exit {code} at {incarnation.crash_point}")
            self.start(slot)
            restarted.add(incarnation.service)
        return restarted

    def stop(self) -> None:
        for incarnation in self.running.values():
            incarnation.process.stop()

    def tails(self) -> str:
        return "\n".join(f"--- {slot}\n{i.process.tail(15)}" for slot, i in self.running.items())


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL ``service`` once ``at`` is reached: the fraction of documents indexed, or for the
    fetcher the fraction of the folder its current sync has listed."""

    service: str
    at: float


def kill_schedule(rng: random.Random) -> list[Kill]:
    """Every service at least once, some twice. Consumer kills come after 10% is indexed: replica 0,
    which holds at least one of the three partitions, has then long passed its crash point (at most
    40 messages), so the deterministic crash and the random kills do not pre-empt each other."""
    kills = [Kill(FETCHER, rng.uniform(0.1, 0.5)), Kill(FETCHER, rng.uniform(0.2, 0.8))]
    for name in CONSUMERS:
        kills += [Kill(name, rng.uniform(0.1, 0.9)) for _ in range(rng.randint(1, 2))]
    return kills


def trigger_sync(fetcher: ServiceProcess, folder: Path) -> bool:
    """Start a sync without waiting for it (the fetcher may be killed in the middle of it); False
    when the request timed out on the loaded machine and must be sent again."""
    try:
        response = httpx.post(f"{fetcher.url}/v1/syncs", json={"path": str(folder)}, timeout=30)
    except httpx.TimeoutException:
        return False
    # 409: a timed-out earlier request did start it. A killed fetcher's run is no reason: its owner
    # lock went with the process, so the restarted fetcher fails that run at once and starts anew.
    assert response.status_code in (202, 409), response.text
    return response.status_code == 202


def sync_state(fetcher: ServiceProcess, connection_id: str) -> tuple[str, int] | None:
    """The fetcher's current sync of the connection: its state and how many items it has listed
    (None when the fetcher was too busy to answer in time)."""
    try:
        response = httpx.get(f"{fetcher.url}/v1/syncs/{connection_id}", timeout=10)
    except httpx.TimeoutException:
        return None
    if response.status_code == 404:  # restarted before this sync began
        return None
    status = response.json()
    return str(status["state"]), int(status["counts"].get("listed", 0))


async def test_killed_services_converge_to_the_clean_index(
    database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    # A database of its own: the fake model's embedding space becomes the active one there (the
    # shared database's is the local model's), and its 2,000 documents stay out of other tests' way.
    async with private_database(database_url) as dsn:
        await _converge(dsn, kafka_bootstrap, tmp_path)


async def _converge(dsn: str, kafka_bootstrap: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_corpus(corpus, DOCUMENTS)
    shutil.copytree(corpus, tmp_path / "clean")
    connection_id = FolderConnector(corpus).connection_id
    rng = random.Random(SEED)
    schedule = kill_schedule(rng)
    # Each consumer's first incarnation dies at a named point, between its durable output (published;
    # for the indexer, committed to PostgreSQL) and its offset commit, so its input is redelivered.
    points = {
        "chunker": rng.choice(("chunker.before_publish", "chunker.after_publish")),
        "embedder": rng.choice(("embedder.before_publish", "embedder.after_publish")),
        "indexer": rng.choice(("indexer.before_publish", "indexer.after_publish")),
    }
    logs = tmp_path / "logs"
    logs.mkdir()

    with run_fake_dashscope() as fake:
        started = time.monotonic()
        clean = await clean_run(tmp_path / "clean", dsn, fake, DIMENSION)
        assert len(clean) == DOCUMENTS
        clean_wall, started = time.monotonic() - started, time.monotonic()
        env = {
            "DATABASE_URL": dsn,
            "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "RAGSTREAM_KAFKA_SESSION_TIMEOUT_MS": "6000",
            "RAGSTREAM_FETCHER_INTERVAL_S": "0",
            "RAGSTREAM_CHUNK_BATCH_CHUNKS": "2",
            "RAGSTREAM_EMBEDDER_PROVIDER": "dashscope",
            "RAGSTREAM_EMBEDDER_BASE_URL": fake.base_url,
            "RAGSTREAM_EMBEDDER_API_KEY": fake.api_key,
            "RAGSTREAM_EMBEDDER_DIMENSION": str(DIMENSION),
            "RAGSTREAM_ALLOW_PRIVATE_NETWORKS": "true",
            "RAGSTREAM_FOLDER_ROOTS": str(tmp_path),
        }
        chaos = Chaos(env, logs, rng, points)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        try:
            for slot in (*(f"{name}/{replica}" for name in CONSUMERS for replica in range(REPLICAS)), f"{FETCHER}/0"):
                chaos.start(slot)
            syncs = await drive(chaos, schedule, corpus, pool)
            wall = time.monotonic() - started
        finally:
            chaos.stop()
    try:
        faulty = await indexed_documents(pool, connection_id)
        chunk_rows = await count(
            pool,
            "SELECT count(*) FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1",
            connection_id,
        )
        # Not asserted: content staged by a fetcher killed before it published the change, for a
        # document an earlier announcement then committed. It is never read; it only takes space.
        orphans = await count(
            pool,
            "SELECT count(*) FROM staged_documents s JOIN documents d ON d.id = s.document_id"
            " WHERE d.connection_id = $1 AND s.version > d.version",
            connection_id,
        )
        print(
            f"\nfault injection: seed {SEED}, {DOCUMENTS} documents, {chunk_rows} chunks, {syncs} syncs,"
            f" SIGKILLs {dict(chaos.kills)}, crash points {dict(chaos.crashes)},"
            f" faulty run {wall:.0f} s (clean run {clean_wall:.0f} s), {orphans} staged versions never announced"
            "\n  " + "; ".join(chaos.exits)
        )
        await assert_same_index(pool, connection_id, faulty, clean, chunk_rows, DIMENSION)
        assert chaos.crashes == Counter(CONSUMERS), chaos.crashes
        assert set(chaos.kills) == {FETCHER, *CONSUMERS}, chaos.kills
    finally:
        await pool.close()


async def drive(chaos: Chaos, schedule: list[Kill], corpus: Path, pool: asyncpg.Pool) -> int:
    """Run the sync under the kill schedule until the pipeline is quiescent; returns the syncs started.

    Quiescent: the last sync has listed the whole folder, no kill is left, and every stage group has
    committed to the end of its topics, so nothing more can happen. No condition on the index
    itself: what it holds then is what the assertions judge.
    """
    connection_id = FolderConnector(corpus).connection_id
    started = time.monotonic()
    syncs, sync_wanted, sync_done, listed = 0, True, False, 0
    async with KafkaLag(chaos.env["KAFKA_BOOTSTRAP_SERVERS"]) as lag:
        while True:
            assert time.monotonic() - started < QUIESCENCE_TIMEOUT_S, (
                f"not quiescent after {QUIESCENCE_TIMEOUT_S} s; kills left {schedule}\n{chaos.tails()}"
            )
            if FETCHER in chaos.reap():
                sync_wanted = True
            fetcher = chaos.running[f"{FETCHER}/0"].process
            if sync_wanted and chaos.is_ready(f"{FETCHER}/0"):
                if trigger_sync(fetcher, corpus):
                    syncs, sync_wanted, sync_done, listed = syncs + 1, False, False, 0
            elif not sync_wanted and not sync_done and (current := sync_state(fetcher, connection_id)):
                state, listed = current
                assert state != "failed", state
                sync_done = state == "ready"
            indexed = await count(
                pool, "SELECT count(*) FROM documents WHERE connection_id = $1 AND status = 'indexed'", connection_id
            )
            for kill in schedule:
                if kill.service == FETCHER:
                    # During a sync once it has listed that much of the folder; if the sync ends
                    # first, the idle fetcher is killed (and the next sync must find nothing lost).
                    due = not sync_wanted and (sync_done or listed >= kill.at * DOCUMENTS)
                else:
                    due = indexed >= kill.at * DOCUMENTS
                if due and chaos.kill(kill.service):
                    schedule.remove(kill)
                    sync_wanted = sync_wanted or kill.service == FETCHER
                    break
            if sync_done and not sync_wanted and not schedule and await lag.drained():
                return syncs
            await asyncio.sleep(0.3)
