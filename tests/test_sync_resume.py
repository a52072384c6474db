"""Interrupted syncs resume from their cursors: nothing staged is downloaded twice, the index ends as a
clean run's, and the runs say which walk they were (backward first, forward after)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from ragstream.api.syncs import SyncRunView
from ragstream.connectors.base import SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream.connectors.registry import register_folder
from ragstream.failures import StageFailure, record_failure
from ragstream.jobs.progress import SyncProgress
from ragstream.messages import DocumentChanged, DocumentDeleted
from ragstream.runtime import Runtime
from ragstream.stages.fetch import FetchService
from ragstream.storage.runs import RunStatus, RunStore
from tests.support.runs import sync_runner

pytestmark = pytest.mark.integration

DOCUMENTS = 12


class PlatformDown(Exception):
    """The platform stopped answering in the middle of a sync."""


class CountingFolder(FolderConnector):
    """A folder that records every download and can go down after ``fail_after`` of them. Without
    ``versions`` it lists no cheap version, like a platform whose listing has none: every item must
    then be downloaded for its hash to be compared."""

    def __init__(self, root: Path, fail_after: int | None = None, *, versions: bool = True) -> None:
        super().__init__(root)
        self.fail_after = fail_after
        self.versions = versions
        self.downloaded: list[str] = []

    async def list_items(self) -> AsyncIterator[SourceItem]:
        async for item in super().list_items():
            yield item if self.versions else replace(item, source_version=None)

    async def fetch(self, item: SourceItem) -> bytes:
        if self.fail_after is not None and len(self.downloaded) >= self.fail_after:
            raise PlatformDown(f"gone after {self.fail_after} downloads")
        content = await super().fetch(item)
        self.downloaded.append(item.external_id)
        return content


def write_corpus(tmp_path: Path) -> Path:
    """The test corpus under ``tmp_path``. Its names sort differently as paths than as names
    ("a-b" < "a.md" < "a/"): the cursor must hold."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a").mkdir()
    for index in range(DOCUMENTS):
        name = f"a/doc-{index:02}.md" if index % 3 == 0 else f"a-{index:02}.md"
        (folder / name).write_text(f"# Doc {index}\n\nResume term orchidvault number {index}.\n\nMore text {index}.\n")
    return folder


async def synced_then_stopped(runtime: Runtime, tmp_path: Path, *, versions: bool, after: str, seen: int) -> Path:
    """A corpus synced once, then a forward walk that stopped after ``after`` (``seen`` items listed):
    the next sync resumes it."""
    corpus = write_corpus(tmp_path)
    connection_id = CountingFolder(corpus).connection_id
    assert (await runtime.pipeline().sync(CountingFolder(corpus, versions=versions))).ok
    await runtime.store.cursors.begin(connection_id, "download")
    await runtime.store.cursors.advance(connection_id, "download", after, seen)
    return corpus


async def index_of(runtime: Runtime, connection_id: str) -> list[tuple[str, str, int, str]]:
    rows = await runtime.pool.fetch(
        "SELECT d.source, d.content_hash, c.ordinal, c.text FROM documents d JOIN chunks c ON c.document_id = d.id"
        " WHERE d.connection_id = $1 AND d.status = 'indexed' ORDER BY 1, 3",
        connection_id,
    )
    return [(row["source"], row["content_hash"], row["ordinal"], row["text"]) for row in rows]


@pytest.mark.parametrize("versions", [True, False], ids=["versioned", "versionless"])
async def test_an_interrupted_sync_resumes_without_downloading_again(
    runtime: Runtime, tmp_path: Path, versions: bool
) -> None:
    corpus = write_corpus(tmp_path)
    cursors = runtime.store.cursors
    down = CountingFolder(corpus, fail_after=7, versions=versions)
    connection_id = down.connection_id

    with pytest.raises(BaseException) as stopped:
        await runtime.pipeline().sync(down)
    assert isinstance(stopped.value, BaseExceptionGroup) and stopped.value.subgroup(PlatformDown) is not None
    assert len(down.downloaded) == 7
    download = await cursors.get(connection_id, "download")
    index = await cursors.get(connection_id, "index")
    assert download is not None and index is not None
    assert (download.direction, download.completed, index.completed) == ("backward", False, False)
    # The cursor stands on the last download: the listing ascends, so it is the greatest id downloaded.
    assert download.position == max(down.downloaded)
    staged_unindexed = await runtime.store.pending_staged(connection_id)
    assert staged_unindexed, "the interruption left no staged, unindexed document to resume"
    assert set(staged_unindexed) <= set(down.downloaded)
    # One staged document is edited while the sync is down: its cheap version tells, so it is downloaded
    # again. A listing without versions cannot tell: all it staged is downloaded again to compare.
    edited = min(staged_unindexed)
    (corpus / edited).write_text("# Edited\n\nChanged while the sync was down: orchidvault edited.\n")
    redownloaded = {edited} if versions else set(staged_unindexed)

    again = CountingFolder(corpus, versions=versions)
    resumed = await runtime.pipeline().sync(again)

    assert resumed.ok, resumed.failures
    assert (resumed.progress.direction, resumed.progress.resumed) == ("backward", True)
    # Nothing downloaded before the interruption is downloaded again (but what may have been edited);
    # the rest is, once.
    assert set(again.downloaded) & set(down.downloaded) == redownloaded
    listing = [item.external_id async for item in again.list_items()]
    assert sorted(again.downloaded + down.downloaded) == sorted(listing + sorted(redownloaded))
    assert resumed.progress.indexed == DOCUMENTS - (7 - len(staged_unindexed))
    assert await runtime.store.pending_staged(connection_id) == {}
    for stage in ("download", "index"):
        cursor = await cursors.get(connection_id, stage)
        assert (
            cursor is not None
            and cursor.completed
            and cursor.items == (DOCUMENTS if stage == "download" else resumed.progress.indexed)
        )

    forward = CountingFolder(corpus, versions=versions)
    incremental = await runtime.pipeline().sync(forward)
    assert (incremental.progress.direction, incremental.progress.resumed) == ("forward", False)
    # Unchanged documents are not even downloaded when the listing has versions; without, SHA-256 decides.
    assert len(forward.downloaded) == (0 if versions else DOCUMENTS)
    assert (incremental.progress.unchanged, incremental.progress.indexed) == (DOCUMENTS, 0)

    # The same corpus synced cleanly elsewhere indexes the same documents and chunks, none twice.
    clean_corpus = tmp_path / "clean"
    shutil.copytree(corpus, clean_corpus)
    clean = await runtime.pipeline().sync(FolderConnector(clean_corpus))
    assert clean.ok and clean.progress.indexed == DOCUMENTS
    resumed_index = await index_of(runtime, connection_id)
    assert resumed_index == await index_of(runtime, FolderConnector(clean_corpus).connection_id)
    assert len({(source, ordinal) for source, _, ordinal, _ in resumed_index}) == len(resumed_index)
    assert len({source for source, *_ in resumed_index}) == DOCUMENTS


class LostQueue:
    """The embedded runner's queue of a process that dies: announced, never indexed."""

    async def changed(self, message: DocumentChanged) -> None:
        pass

    async def deleted(self, message: DocumentDeleted) -> None:
        pass


async def test_what_the_index_side_never_indexed_is_indexed_from_staging(runtime: Runtime, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    connector = CountingFolder(corpus)
    # The process completed the download walk, then died with everything still in its queue.
    fetch = FetchService(runtime.store, connector, max_document_bytes=runtime.settings.max_document_bytes)
    await fetch.register()
    await runtime.store.cursors.begin(connector.connection_id, "index")
    assert (await fetch.run(LostQueue())).changed == DOCUMENTS
    assert len(connector.downloaded) == DOCUMENTS

    after = CountingFolder(corpus)
    report = await runtime.pipeline().sync(after)

    # The download walk had completed, so this one is forward; the unfinished index walk resumes.
    assert (report.progress.direction, report.progress.resumed) == ("forward", True)
    assert (after.downloaded, report.progress.indexed) == ([], DOCUMENTS)


async def test_a_forward_sync_downloads_only_changes_and_finds_deletions(runtime: Runtime, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    assert (await runtime.pipeline().sync(CountingFolder(corpus))).progress.direction == "backward"

    (corpus / "a-01.md").write_text("# Doc 1\n\nRewritten: orchidvault moved.\n")
    (corpus / "a" / "doc-03.md").unlink()
    (corpus / "a" / "new.md").write_text("# New\n\nA new orchidvault page.\n")
    forward = CountingFolder(corpus)
    report = await runtime.pipeline().sync(forward)

    assert (report.progress.direction, report.progress.resumed) == ("forward", False)
    assert sorted(forward.downloaded) == ["a-01.md", "a/new.md"]
    assert (report.progress.indexed, report.progress.deleted, report.progress.unchanged) == (2, 1, DOCUMENTS - 2)


async def test_a_stopped_run_is_resumed_by_the_next_and_says_so(runtime: Runtime, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    connection_id = await register_folder(runtime.store, corpus)
    runs = RunStore(runtime.pool, runtime.dsn)
    try:
        runner = sync_runner(runs, runtime.pipeline, progress_interval_s=0.05)
        first = await runs.start(connection_id, "api", running=True)

        def stop_after_four(progress: SyncProgress) -> None:
            if progress.changed >= 4:
                task.cancel()  # as when the process stops

        task = asyncio.create_task(runner.execute(first, stop_after_four))
        with pytest.raises(asyncio.CancelledError):
            await task
        stopped = await runs.get(first.id)
        assert stopped is not None and stopped.status is RunStatus.FAILED
        assert (stopped.error, stopped.progress["direction"]) == ("cancelled: the process stopped", "backward")
        staged_first = dict(
            await runtime.pool.fetch(
                "SELECT document_id, version FROM staged_documents WHERE connection_id = $1", connection_id
            )
        )
        assert 4 <= len(staged_first) < DOCUMENTS

        second = await runner.execute(await runs.start(connection_id, "api", running=True))
        third = await runner.execute(await runs.start(connection_id, "api", running=True))

        assert second.run is not None and third.run is not None
        assert (second.run.status, second.run.progress["direction"], second.run.progress["resumed"]) == (
            RunStatus.SUCCEEDED,
            "backward",
            True,
        )
        walk = third.run.progress
        assert (walk["direction"], walk["resumed"], walk["changed"]) == (
            "forward",
            False,
            0,
        )
        view = SyncRunView.of(third.run)
        assert (view.direction, view.resumed) == ("forward", False)
        # Each document staged before the stop was indexed from that staging, not downloaded again.
        committed = dict(
            await runtime.pool.fetch(
                "SELECT id, version FROM documents WHERE connection_id = $1 AND status = 'indexed'", connection_id
            )
        )
        assert len(committed) == DOCUMENTS
        assert {document: committed[document] for document in staged_first} == staged_first
    finally:
        await runs.aclose()


@pytest.mark.parametrize("versions", [True, False], ids=["versioned", "versionless"])
async def test_a_resumed_walk_examines_what_changed_behind_its_cursor(
    runtime: Runtime, tmp_path: Path, versions: bool
) -> None:
    corpus = await synced_then_stopped(runtime, tmp_path, versions=versions, after="a-10.md", seen=7)
    connection_id = CountingFolder(corpus).connection_id
    # Meanwhile, behind the cursor: a committed document is edited and a new one appears.
    (corpus / "a-01.md").write_text("# Doc 1\n\nEdited behind the cursor: orchidvault moved.\n")
    (corpus / "a-00.md").write_text("# New\n\nA new orchidvault page behind the cursor.\n")

    again = CountingFolder(corpus, versions=versions)
    report = await runtime.pipeline().sync(again)

    assert report.ok and report.progress.resumed
    # The new document is never skipped; the edit is found by its cheap version, with no other
    # download behind the cursor. Without versions the committed documents there are not read again.
    expected = ["a-00.md", "a-01.md"] if versions else ["a-00.md"]
    assert [external_id for external_id in again.downloaded if external_id <= "a-10.md"] == expected
    assert report.progress.indexed == len(expected)
    indexed = {source for source, *_ in await index_of(runtime, connection_id)}
    assert "a-00.md" in indexed


async def test_a_staged_version_that_failed_for_good_is_not_announced_again(runtime: Runtime, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    connector = CountingFolder(corpus)
    fetch = FetchService(runtime.store, connector, max_document_bytes=runtime.settings.max_document_bytes)
    await fetch.register()
    await fetch.run(LostQueue())  # everything staged, nothing indexed
    staged = await runtime.store.pending_staged(connector.connection_id)
    assert len(staged) == DOCUMENTS
    # One version failed for good (a parser rejected it); another failed for now, and was given up on.
    rejected, unavailable = staged["a-01.md"], staged["a-02.md"]
    await record_failure(runtime.store, rejected, "parse", StageFailure("binary", "not text", retryable=False))
    await record_failure(
        runtime.store, unavailable, "embed", StageFailure("embedding_unavailable", "503", retryable=True)
    )

    pending = await runtime.store.pending_staged(connector.connection_id)

    assert set(pending) == set(staged) - {"a-01.md"}


class DescendingFolder(CountingFolder):
    """A connector that breaks the contract: it lists in descending external id order."""

    async def list_items(self) -> AsyncIterator[SourceItem]:
        items = [item async for item in super().list_items()]
        for item in sorted(items, key=lambda item: item.external_id, reverse=True):
            yield item


async def test_a_listing_out_of_order_is_walked_in_full(
    runtime: Runtime, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = await synced_then_stopped(runtime, tmp_path, versions=False, after="a-05.md", seen=4)

    disordered = DescendingFolder(corpus, versions=False)
    report = await runtime.pipeline().sync(disordered)

    # Nothing behind the cursor is trusted as walked: every document is read to compare its hash.
    assert report.ok and report.progress.resumed
    assert sorted(disordered.downloaded) == sorted([item.external_id async for item in disordered.list_items()])
    assert "out of ascending id order" in caplog.text


async def test_a_sync_of_an_empty_folder_records_its_direction(runtime: Runtime, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    first = await runtime.pipeline().sync(FolderConnector(empty))
    second = await runtime.pipeline().sync(FolderConnector(empty))
    assert [(report.progress.direction, report.progress.resumed) for report in (first, second)] == [
        ("backward", False),
        ("forward", False),
    ]
