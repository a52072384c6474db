"""Replay in the embedded runner: failed documents are re-driven from their staged content, as a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.api.replays import replay_router
from ragstream.api.runs import runs_router
from ragstream.connectors.folder import FolderConnector
from ragstream.control.kinds import FAILURES, pipeline_replay_kind
from ragstream.control.runner import Runner
from ragstream.embedding.base import EmbeddingError, TextKind, Vectors
from ragstream.failures import StageRetry
from ragstream.pipeline import EmbeddedPipeline
from ragstream.runtime import Runtime
from ragstream.stages.embed import EmbedService
from ragstream.storage.runs import RunStore
from tests.test_cli import run

pytestmark = pytest.mark.integration


class OutageEmbedder:
    """The runtime's embedder behind a switch: while ``down``, texts that mention ``brittle`` fail."""

    def __init__(self, runtime: Runtime) -> None:
        self._inner = runtime.embedder
        self.model_key, self.dimension = runtime.embedder.model_key, runtime.embedder.dimension
        self.down = True

    async def warm_up(self) -> None:
        await self._inner.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if self.down and any("brittle" in text for text in texts):
            raise EmbeddingError("provider outage (503)", retryable=True, provider="test")
        return await self._inner.embed(texts, kind)

    async def aclose(self) -> None:
        pass


def pipeline_with(runtime: Runtime, embedder: OutageEmbedder) -> EmbeddedPipeline:
    return EmbeddedPipeline(
        runtime.store,
        runtime.chunker,
        EmbedService(embedder),
        runtime.indexer,
        max_document_bytes=runtime.settings.max_document_bytes,
        retry=StageRetry(attempts=1),  # one attempt per drive: the retry count then counts the replays
    )


def write_corpus(folder: Path) -> None:
    for n in range(6):
        (folder / f"steady-{n}.md").write_text(f"# Steady {n}\n\nThe steady page number {n} about ferries.\n")
    for n in range(3):
        (folder / f"fragile-{n}.md").write_text(f"# Fragile {n}\n\nThe brittle page number {n} about gliders.\n")


async def chunk_rows(runtime: Runtime, connection: str) -> list[tuple[str, int]]:
    rows = await runtime.pool.fetch(
        "SELECT d.source, c.ordinal FROM chunks c JOIN documents d ON d.id = c.document_id"
        " WHERE d.connection_id = $1 ORDER BY 1, 2",
        connection,
    )
    return [(row["source"], row["ordinal"]) for row in rows]


async def test_replay_indexes_what_failed_once_the_cause_is_gone(runtime: Runtime, tmp_path: Path) -> None:
    write_corpus(tmp_path)
    embedder = OutageEmbedder(runtime)
    pipeline = pipeline_with(runtime, embedder)
    connection = FolderConnector(tmp_path).connection_id

    report = await pipeline.sync(FolderConnector(tmp_path))
    assert sorted(failure.source for failure in report.failures) == [f"fragile-{n}.md" for n in range(3)]
    assert {(failure.step, failure.code) for failure in report.failures} == {("embed", "embedding_unavailable")}

    # Still down: replaying fails again, and says so with a growing retry count.
    counts, progress = await pipeline.replay(connection)
    assert (counts.replayed, progress.indexed, progress.failed) == (3, 0, 3)
    assert {failure.retry_count for failure in await runtime.store.failures(connection)} == {1}

    embedder.down = False
    counts, progress = await pipeline.replay(connection)
    assert (counts.replayed, progress.indexed, progress.failed) == (3, 3, 0)
    assert await runtime.store.failures(connection) == []
    rows = await chunk_rows(runtime, connection)
    assert len(rows) == len(set(rows)) == 9
    # Nothing left to replay, and a later sync finds every file unchanged.
    assert (await pipeline.replay(connection))[0].replayed == 0
    again = await pipeline.sync(FolderConnector(tmp_path))
    assert (again.progress.unchanged, again.progress.indexed) == (9, 0)


async def test_replay_skips_superseded_failures_and_counts_fetch_failures(runtime: Runtime, tmp_path: Path) -> None:
    write_corpus(tmp_path)
    embedder = OutageEmbedder(runtime)
    pipeline = pipeline_with(runtime, embedder)
    connection = FolderConnector(tmp_path).connection_id
    await pipeline.sync(FolderConnector(tmp_path))
    # fragile-0 is fixed at the source and synced (a newer version commits); fragile-1 vanishes.
    (tmp_path / "fragile-0.md").write_text("# Fragile 0\n\nRewritten without the trigger word.\n")
    (tmp_path / "fragile-1.md").unlink()
    (tmp_path / "huge.md").write_text("x" * 400)
    small = replace(runtime, settings=runtime.settings.model_copy(update={"max_document_bytes": 200}))
    report = await pipeline_with(small, embedder).sync(FolderConnector(tmp_path))
    assert {failure.source for failure in report.failures} == {"fragile-2.md", "huge.md"}

    embedder.down = False
    counts, progress = await pipeline.replay(connection)
    assert (counts.replayed, counts.needs_sync, progress.indexed) == (1, 1, 1)
    assert [failure.source for failure in await runtime.store.failures(connection)] == ["huge.md"]
    rows = await chunk_rows(runtime, connection)
    assert "fragile-1.md" not in {source for source, _ in rows}
    assert len(rows) == len(set(rows))


def test_replay_command_reports_and_exits_by_outcome(database_url: str, tmp_path: Path) -> None:
    env = {"DATABASE_URL": database_url, "COLUMNS": "160"}
    (tmp_path / "empty.md").write_text("")
    (tmp_path / "fine.md").write_text("# Fine\n\nA fine page.\n")
    assert run(["ingest", str(tmp_path)], env).returncode == 1
    result = run(["replay", "--connection", FolderConnector(tmp_path).connection_id], env)
    # An empty file fails when parsed, for good: replaying it fails again, and the exit says so.
    assert result.returncode == 1, result.stderr
    assert "replayed 1 (0 indexed, 1 failed again)" in result.stderr
    assert "empty.md" in result.stderr
    assert run(["replay", "--dead-letter"], env).returncode == 2


async def test_a_replay_over_the_api_is_a_run_with_its_counts(runtime: Runtime, tmp_path: Path) -> None:
    write_corpus(tmp_path)
    embedder = OutageEmbedder(runtime)
    pipeline = pipeline_with(runtime, embedder)
    connection = FolderConnector(tmp_path).connection_id
    assert len((await pipeline.sync(FolderConnector(tmp_path))).failures) == 3
    embedder.down = False
    runs = RunStore(runtime.pool, runtime.dsn)
    runner = Runner(runs, {"replay": pipeline_replay_kind(lambda: pipeline)})

    async def ready() -> bool:
        return True

    app = create_app(
        lambda: runtime.retriever, ready=ready, routers=[replay_router(runs, runner, [FAILURES]), runs_router(runs)]
    )
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            letters = await client.post("/v1/replays", json={"source": "dead-letter"})
            assert letters.status_code == 422  # embedded mode has no dead-letter topic
            replayed = await client.post("/v1/replays", json={"connection_id": connection})
            assert replayed.status_code == 200, replayed.text
            result = replayed.json()
            assert (result["replayed"], result["indexed"], result["failed_again"]) == (3, 3, 0)
            run = (await client.get(f"/v1/runs/{result['run_id']}")).json()
    finally:
        await runs.aclose()
    assert (run["kind"], run["connection_id"], run["status"], run["params"]) == (
        "replay",
        connection,
        "succeeded",
        {"source": "failures"},
    )
    assert {name: run["progress"][name] for name in ("replayed", "indexed", "failed_again", "total", "done")} == {
        "replayed": 3,
        "indexed": 3,
        "failed_again": 0,
        "total": 3,
        "done": 3,
    }
    assert await runtime.store.failures(connection) == []
