"""The Kafka pipeline's characters/s against the raw embedder's on the same texts.

    .venv/bin/python -m bench.kafka_embed_share [--documents 200] [--seed 20261202]

A private PostgreSQL and a single-node Kafka broker; ``--documents`` seeded Markdown pages (2 to 8
sections of 300 to 1,200 characters) in a folder. The chunker, embedder and indexer services run
as their ``register_handlers`` declare them (``tests/support/stages.py``: real Kafka, in this
process), with the default settings and the local USE embedder; one sync of the folder through
``KafkaTransport`` is timed. The same corpus, copied to a second folder (a second connection), then
goes through the embedded pipeline (``runtime.pipeline()``). Last, the raw embedder (the model
alone, in batches of 16, 32 and 64) on exactly the texts the Kafka run embedded.

Printed per run: documents, chunks, characters embedded, seconds, characters/s and its share of the
fastest raw run's, the embedder's calls, texts per call and busy share (its passes' seconds over the
run's), and the load average before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.support is imported from the repository, not installed
    sys.path.insert(0, str(REPO))

from bench.embed_ceiling import WORDS  # noqa: E402
from ragstream.connectors.folder import FolderConnector  # noqa: E402
from ragstream.embedding.local import LocalUSEEmbedder  # noqa: E402
from ragstream.jobs.sync import SyncJob  # noqa: E402
from ragstream.local_kafka import KafkaNode  # noqa: E402
from ragstream.runtime import Runtime, open_runtime  # noqa: E402
from ragstream.settings import Settings  # noqa: E402
from ragstream.stages.embed import embedding_input  # noqa: E402
from ragstream.storage.downstream import DownstreamStore  # noqa: E402
from ragstream.storage.embedded_postgres import EmbeddedPostgres  # noqa: E402
from ragstream.transport.kafka import KafkaTransport  # noqa: E402
from tests.support.stages import kafka_stages  # noqa: E402

# USE pads a pass to its longest text, so the best batch size depends on the texts: the raw
# embedder's figure is the fastest of these.
RAW_BATCHES = (16, 32, 64)


def write_corpus(folder: Path, documents: int, seed: int) -> None:
    """``documents`` Markdown pages of 2 to 8 sections, each 300 to 1,200 characters of words."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for number in range(documents):
        sections = []
        for section in range(rng.randint(2, 8)):
            words: list[str] = []
            while sum(len(word) + 1 for word in words) < rng.randint(300, 1200):
                words.append(rng.choice(WORDS))
            sections.append(f"## Section {section}\n\n{' '.join(words)}.\n")
        (folder / f"page-{number:04}.md").write_text(f"# Page {number}\n\n" + "\n".join(sections))


class EncodeCounter:
    """Wraps the USE model's ``_encode`` to count its calls, their texts and the seconds they took."""

    def __init__(self, embedder: LocalUSEEmbedder) -> None:
        self.calls: list[tuple[int, float]] = []
        self._encode: Callable[[list[str]], Any] = embedder._encode
        embedder._encode = self.encode  # type: ignore[method-assign]

    def encode(self, texts: list[str]) -> Any:
        started = time.perf_counter()
        try:
            return self._encode(texts)
        finally:
            self.calls.append((len(texts), time.perf_counter() - started))

    def take(self) -> list[tuple[int, float]]:
        calls, self.calls = self.calls, []
        return calls


async def embedded_texts(runtime: Runtime, folder: Path) -> list[str]:
    """What the pipeline embedded for ``folder``'s documents, chunk by chunk."""
    rows = await runtime.pool.fetch(
        "SELECT d.title, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
        " WHERE d.connection_id = $1 ORDER BY d.id, c.ordinal",
        FolderConnector(folder).connection_id,
    )
    return [embedding_input(row["title"], row["heading"], row["text"]) for row in rows]


def row(
    mode: str, documents: int, texts: list[str], seconds: float, calls: list[tuple[int, float]], load: float
) -> dict[str, Any]:
    """One run's figures; ``calls`` are the embedder's (texts, seconds), ``seconds`` the run's."""
    characters = sum(len(text) for text in texts)
    return {
        "mode": mode,
        "documents": documents,
        "chunks": len(texts),
        "characters": characters,
        "seconds": round(seconds, 2),
        "characters_per_s": round(characters / seconds, 1),
        "embedder_calls": len(calls),
        "texts_per_call": round(sum(count for count, _ in calls) / max(len(calls), 1), 1),
        "embedder_busy_share": round(sum(busy for _, busy in calls) / seconds, 3),
        "load1_before": round(load, 2),
    }


async def measure(dsn: str, bootstrap: str, corpus: Path, copy: Path) -> list[dict[str, Any]]:
    async with open_runtime(Settings(database_url=dsn), dsn) as runtime:
        embedder = runtime.embedder
        if not isinstance(embedder, LocalUSEEmbedder):
            raise SystemExit("this bench runs the local USE embedder (RAGSTREAM_EMBEDDER_PROVIDER=local)")
        await embedder.warm_up()
        counter = EncodeCounter(embedder)
        rows = []
        async with kafka_stages(runtime, bootstrap) as broker:
            job = SyncJob(
                runtime.store,
                KafkaTransport(broker, DownstreamStore(runtime.pool), poll_interval_s=0.05),
                max_document_bytes=runtime.settings.max_document_bytes,
            )
            load, started = os.getloadavg()[0], time.perf_counter()
            report = await job.sync(FolderConnector(corpus))
            seconds = time.perf_counter() - started
        texts = await embedded_texts(runtime, corpus)
        rows.append(row("kafka", report.progress.indexed, texts, seconds, counter.take(), load))
        load, started = os.getloadavg()[0], time.perf_counter()
        report = await runtime.pipeline().sync(FolderConnector(copy))
        seconds = time.perf_counter() - started
        rows.append(
            row("embedded", report.progress.indexed, await embedded_texts(runtime, copy), seconds, counter.take(), load)
        )
        model = embedder._load()
        for batch in RAW_BATCHES:
            calls: list[tuple[int, float]] = []
            load, started = os.getloadavg()[0], time.perf_counter()
            for start in range(0, len(texts), batch):
                passed = time.perf_counter()
                model.encode(texts[start : start + batch])
                calls.append((len(texts[start : start + batch]), time.perf_counter() - passed))
            seconds = time.perf_counter() - started
            rows.append(row(f"raw embedder, batches of {batch}", rows[0]["documents"], texts, seconds, calls, load))
    raw = max(measured["characters_per_s"] for measured in rows[2:])
    for measured in rows:
        measured["share_of_raw"] = round(measured["characters_per_s"] / raw, 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261202)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ragstream-bench-kafka-share-"))
    # A folder of its own directly in /tmp: the server's account (when we are root) must reach it.
    pg_dir = Path(tempfile.mkdtemp(prefix="ragstream-bench-pg-"))
    corpus, copy = work / "corpus", work / "copy"
    write_corpus(corpus, args.documents, args.seed)
    shutil.copytree(corpus, copy)
    postgres, node = EmbeddedPostgres(pg_dir), KafkaNode(work / "kafka")
    try:
        dsn, bootstrap = postgres.start(), node.start()
        rows = asyncio.run(measure(dsn, bootstrap, corpus, copy))
    finally:
        node.stop()
        postgres.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(pg_dir, ignore_errors=True)
    print(
        "| mode | documents | chunks | characters | s | chars/s | share of raw | embedder calls | texts/call "
        "| embedder busy | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for measured in rows:
        print(
            f"| {measured['mode']} | {measured['documents']} | {measured['chunks']} | {measured['characters']:,} "
            f"| {measured['seconds']} | {measured['characters_per_s']:,} | {measured['share_of_raw']:.1%} "
            f"| {measured['embedder_calls']} | {measured['texts_per_call']} | {measured['embedder_busy_share']:.0%} "
            f"| {measured['load1_before']} |"
        )
    print(json.dumps({"documents": args.documents, "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
