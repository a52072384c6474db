"""The sync job's behaviour, the same over both transports: in-memory workers, and the Kafka stage
services on a real broker. The guard stops a degraded sync and it deletes nothing; deletions go
last; transient failures are retried per document; a document refused as stale by a switch is run
again at once; progress carries its rate and ETA; a second sync of a connection is refused while one
runs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.api.syncs import sync_router
from ragstream.connectors import registry
from ragstream.connectors.base import SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream.degradation import EmbeddingDegraded
from ragstream.embedding.base import EmbeddingError, TextKind, Vectors
from ragstream.failures import StageRetry
from ragstream.jobs.progress import SyncProgress
from ragstream.jobs.sync import SyncJob
from ragstream.messages import ChunksEmbedded, DocumentDeleted, DocumentIndexed
from ragstream.runtime import Runtime
from ragstream.settings import StageRetrySettings
from ragstream.stages.embed import EmbedService
from ragstream.stages.index import IndexService
from ragstream.storage.documents import DocumentStore, StaleChunkingError
from ragstream.storage.downstream import DownstreamStore
from ragstream.storage.runs import RunStatus, RunStore
from ragstream.transport.kafka import KafkaTransport
from ragstream.transport.memory import MemoryTransport
from tests.support.runs import sync_runner
from tests.support.stages import kafka_stages

pytestmark = pytest.mark.integration

_RETRY = StageRetrySettings(attempts=3, backoff_s=0.01, backoff_max_s=0.05)


class SwitchEmbedder:
    """The runtime's model behind a switch: ``ok``; ``flaky``, each text failing its first attempt
    as a throttled provider does; ``down``, every batch rejected for good."""

    def __init__(self, runtime: Runtime) -> None:
        self._inner = runtime.embedder
        self.model_key, self.dimension = runtime.embedder.model_key, runtime.embedder.dimension
        self.mode: Literal["ok", "flaky", "down"] = "ok"
        self._seen: set[str] = set()

    async def warm_up(self) -> None:
        await self._inner.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if self.mode == "down":
            raise EmbeddingError("the provider rejects every batch", retryable=False, provider="test")
        if self.mode == "flaky" and not set(texts) <= self._seen:
            self._seen.update(texts)
            raise EmbeddingError("throttled (429)", retryable=True, provider="test")
        return await self._inner.embed(texts, kind)

    async def aclose(self) -> None:
        """The inner model belongs to the runtime."""


class RecordingIndexer(IndexService):
    """The index stage, noting in order each commit (``index``) and each deletion (``delete``)."""

    def __init__(self, store: DocumentStore) -> None:
        super().__init__(store)
        self.calls: list[tuple[str, str]] = []
        # Refuse each document's first commit as a re-chunk switch would (``refused``).
        self.refuse_once = False

    async def run(self, message: ChunksEmbedded) -> DocumentIndexed | None:
        if self.refuse_once and ("refused", message.header.source) not in self.calls:
            self.calls.append(("refused", message.header.source))
            raise StaleChunkingError(message.header.document_id, message.index_version, message.index_version + 1)
        indexed = await super().run(message)
        if indexed is not None:
            self.calls.append(("index", message.header.source))
        return indexed

    async def delete(self, message: DocumentDeleted) -> DocumentIndexed:
        self.calls.append(("delete", message.source))
        return await super().delete(message)


@dataclass
class Harness:
    """A sync job over one transport, with the embedder and the indexer its stages use."""

    job: SyncJob
    embedder: SwitchEmbedder
    indexer: RecordingIndexer


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
async def harness(request: pytest.FixtureRequest, runtime: Runtime) -> AsyncIterator[Harness]:
    embedder, indexer = SwitchEmbedder(runtime), RecordingIndexer(runtime.store)
    embed = EmbedService(embedder)
    max_bytes = runtime.settings.max_document_bytes
    if request.param == "memory":
        retry = StageRetry(attempts=_RETRY.attempts, backoff_s=_RETRY.backoff_s, backoff_max_s=_RETRY.backoff_max_s)
        transport = MemoryTransport(runtime.store, runtime.chunker, embed, indexer, retry=retry)
        yield Harness(SyncJob(runtime.store, transport, max_document_bytes=max_bytes), embedder, indexer)
        return
    settings = runtime.settings.model_copy(update={"stage_retry": _RETRY, "kafka_session_timeout_ms": 6000})
    stages = replace(runtime, settings=settings, embed=embed, indexer=indexer)
    async with kafka_stages(stages, request.getfixturevalue("kafka_bootstrap")) as broker:
        transport = KafkaTransport(broker, DownstreamStore(runtime.pool), poll_interval_s=0.05)
        yield Harness(SyncJob(runtime.store, transport, max_document_bytes=max_bytes), embedder, indexer)


@pytest.fixture
async def folder(tmp_path: Path, runtime: Runtime) -> AsyncIterator[Path]:
    path = tmp_path / f"kb-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    await runtime.pool.execute("DELETE FROM connections WHERE id = $1", FolderConnector(path).connection_id)


def write(folder: Path, count: int, topic: str, *, start: int = 0) -> None:
    for index in range(start, count):
        (folder / f"page-{index:02}.md").write_text(f"# Page {index}\n\nPage number {index} is about {topic}.\n")


async def indexed_sources(runtime: Runtime, folder: Path) -> set[str]:
    rows = await runtime.pool.fetch(
        "SELECT source FROM documents WHERE connection_id = $1 AND status = 'indexed'",
        FolderConnector(folder).connection_id,
    )
    return {row["source"] for row in rows}


async def test_a_degraded_sync_stops_and_deletes_nothing(harness: Harness, folder: Path, runtime: Runtime) -> None:
    write(folder, 25, "herons")
    assert (await harness.job.sync(FolderConnector(folder))).progress.indexed == 25
    (folder / "page-00.md").unlink()
    write(folder, 25, "egrets", start=1)
    harness.embedder.mode = "down"
    harness.indexer.calls.clear()

    with pytest.raises(EmbeddingDegraded):
        await harness.job.sync(FolderConnector(folder))

    assert harness.indexer.calls == []
    assert await indexed_sources(runtime, folder) == {f"page-{index:02}.md" for index in range(25)}


async def test_deletions_go_after_every_change(harness: Harness, folder: Path, runtime: Runtime) -> None:
    write(folder, 10, "cormorants")
    await harness.job.sync(FolderConnector(folder))
    for index in range(3):
        (folder / f"page-{index:02}.md").unlink()
    write(folder, 8, "pelicans", start=3)
    harness.indexer.calls.clear()

    report = await harness.job.sync(FolderConnector(folder))

    kinds = [kind for kind, _ in harness.indexer.calls]
    assert kinds == ["index"] * 5 + ["delete"] * 3, harness.indexer.calls
    assert (report.progress.indexed, report.progress.deleted, report.progress.unchanged) == (5, 3, 2)
    assert await indexed_sources(runtime, folder) == {f"page-{index:02}.md" for index in range(3, 10)}


async def test_a_transient_failure_is_retried_per_document(harness: Harness, folder: Path, runtime: Runtime) -> None:
    write(folder, 5, "grebes")
    harness.embedder.mode = "flaky"

    report = await harness.job.sync(FolderConnector(folder))

    assert report.ok and report.progress.indexed == 5
    retries = await runtime.pool.fetch(
        "SELECT retry_count FROM documents WHERE connection_id = $1", FolderConnector(folder).connection_id
    )
    assert [row["retry_count"] for row in retries] == [1] * 5


async def test_progress_carries_its_rate_and_eta(harness: Harness, folder: Path) -> None:
    write(folder, 20, "storks")
    seen: list[tuple[int, int, bool, float, float | None]] = []

    def observe(progress: SyncProgress) -> None:
        seen.append((progress.listed, progress.done, progress.listing_done, progress.rate, progress.eta_seconds))

    report = await harness.job.sync(FolderConnector(folder), observe)

    final = report.progress
    assert (final.listed, final.indexed, final.done, final.chunks) == (20, 20, 20, 20)
    assert final.listing_done and final.rate > 0 and final.eta_seconds is None
    assert any(listing_done and 0 < done < listed for listed, done, listing_done, _, _ in seen), seen
    for listed, done, listing_done, rate, eta in seen:
        if (listing_done and done >= listed) or rate == 0:
            assert eta is None
        else:
            # While listing, the workers may have done more than the listing has counted yet: no time left.
            assert eta == pytest.approx(max(listed - done, 0) / rate, rel=0.05)


async def test_a_document_refused_as_stale_is_run_again_at_once(harness: Harness, folder: Path) -> None:
    write(folder, 4, "spoonbills")
    harness.indexer.refuse_once = True

    report = await harness.job.sync(FolderConnector(folder))

    assert report.ok and report.progress.indexed == 4, report.failures
    assert sorted(harness.indexer.calls) == sorted(
        (kind, f"page-{index:02}.md") for index in range(4) for kind in ("index", "refused")
    )


class SlowFolder(FolderConnector):
    """A folder whose downloads take a while, so a sync of it is still running when asked again."""

    async def fetch(self, item: SourceItem) -> bytes:
        await asyncio.sleep(0.05)
        return await super().fetch(item)


async def test_a_second_sync_is_refused_while_one_runs(
    harness: Harness, folder: Path, runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(folder, 20, "ibises")
    monkeypatch.setattr(registry, "FolderConnector", SlowFolder)
    connection_id = await registry.register_folder(runtime.store, folder)
    runs = RunStore(runtime.pool, runtime.dsn)
    runner = sync_runner(runs, lambda: harness.job, progress_interval_s=0.1)

    async def ready() -> bool:
        return True

    app = create_app(None, ready=ready, routers=[sync_router(lambda: runs, runner.wake)])
    try:
        run = await runs.start(connection_id, "api", running=True)
        running = asyncio.create_task(runner.execute(run))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            second = await client.post(f"/v1/connections/{connection_id}/sync")
            assert second.status_code == 409 and "in progress" in second.json()["detail"]
            assert not running.done()
            outcome = await running
            assert outcome.run is not None and outcome.run.status is RunStatus.SUCCEEDED
            assert outcome.run.progress["indexed"] == 20
            again = await client.post(f"/v1/connections/{connection_id}/sync")
            assert again.status_code == 202 and again.json()["status"] == "Queued"
    finally:
        await runs.aclose()
