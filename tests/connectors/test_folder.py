"""The folder connector reads nothing outside its folder: symlinks, FIFOs and dangling links are left
out and reported with their reason, a name that is not UTF-8 indexes, and an entry swapped for a link
after the listing is refused at the read."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ragstream.connectors.base import DocumentUnreadable, SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream.connectors.registry import register_folder
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import Runtime
from ragstream.storage.runs import RunStatus, RunStore
from tests.support.runs import sync_runner

pytestmark = pytest.mark.integration

BAD_NAME = os.fsdecode(b"bad\xffname.md")


@pytest.fixture
async def shared(runtime: Runtime) -> AsyncIterator[Runtime]:
    """The session's runtime; the connections a test adds are deleted after it with their documents."""
    before = [row["id"] for row in await runtime.pool.fetch("SELECT id FROM connections")]
    yield runtime
    await runtime.pool.execute("DELETE FROM connections WHERE NOT (id = ANY($1::text[]))", before)


def hostile_folder(tmp_path: Path) -> Path:
    """Good files beside a link to /etc/passwd, a link to a folder outside, a FIFO and a dangling link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text("# Secret\n\nThe quuxplank password is hunter2.\n")
    folder = tmp_path / "kb"
    (folder / "sub").mkdir(parents=True)
    (folder / "alpha.md").write_text("# Alpha\n\nThe frobnicator listens on port 7411.\n")
    (folder / "sub" / "beta.md").write_text("# Beta\n\nThe zephyrkite flies at dawn.\n")
    (folder / BAD_NAME).write_text("# Odd name\n\nThe glimmerwort grows in odd places.\n")
    (folder / "passwd.md").symlink_to("/etc/passwd")
    (folder / "elsewhere").symlink_to(outside, target_is_directory=True)
    (folder / "dangling.md").symlink_to(tmp_path / "nowhere.md")
    os.mkfifo(folder / "pipe.md")
    (folder / ".hidden.md").write_text("hidden files are left out without a report\n")
    return folder


async def listed(connector: FolderConnector) -> list[SourceItem]:
    return [item async for item in connector.list_items()]


async def test_links_and_special_files_are_skipped_with_their_reason(tmp_path: Path) -> None:
    connector = FolderConnector(hostile_folder(tmp_path))

    items = await listed(connector)

    assert [item.external_id for item in items] == ["alpha.md", "bad%FFname.md", "sub/beta.md"]
    assert connector.skipped == {"symlink": 3, "special_file": 1}
    assert await connector.fetch(items[1]) == (connector.root / BAD_NAME).read_bytes()


async def test_a_sync_indexes_the_good_files_and_reports_the_skipped_ones(shared: Runtime, tmp_path: Path) -> None:
    folder = hostile_folder(tmp_path)
    connection_id = await register_folder(shared.store, folder)
    runs = RunStore(shared.pool, shared.dsn)
    try:
        run = await runs.start(connection_id, "cli", running=True)
        outcome = await sync_runner(runs, shared.pipeline).execute(run)
        done = await runs.get(run.id)
    finally:
        await runs.aclose()

    assert outcome.result is not None and outcome.result.ok, outcome.result
    assert outcome.result.progress.skipped == {"symlink": 3, "special_file": 1}
    assert done is not None and done.status is RunStatus.SUCCEEDED
    assert (done.progress["indexed"], done.progress["skipped"], done.progress["failed"]) == (3, 4, 0)
    sources = await shared.pool.fetch("SELECT source FROM documents WHERE connection_id = $1", connection_id)
    assert sorted(row["source"] for row in sources) == ["alpha.md", "bad%FFname.md", "sub/beta.md"]
    scope = SearchFilters(connection_ids=[connection_id])
    for query, found in (("glimmerwort", ["bad%FFname.md"]), ("quuxplank hunter2", []), ("root", [])):
        response = await shared.retriever.search(SearchRequest(query=query, filters=scope))
        assert [result.source for result in response.results if query.split()[0] in result.text] == found


async def test_an_entry_swapped_after_the_listing_is_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "kb"
    (folder / "sub").mkdir(parents=True)
    for name in ("link.md", "pipe.md", "grown.md", "sub/deep.md"):
        (folder / name).write_text("# Page\n\nlisted as a plain file\n")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "deep.md").write_text("outside the folder\n")
    connector = FolderConnector(folder)
    items = {item.external_id: item for item in await listed(connector)}

    (folder / "link.md").unlink()
    (folder / "link.md").symlink_to("/etc/passwd")
    (folder / "pipe.md").unlink()
    os.mkfifo(folder / "pipe.md")
    (folder / "grown.md").write_text("# Page\n\nlisted as a plain file, then it grew a lot\n")
    (folder / "sub" / "deep.md").unlink()
    (folder / "sub").rmdir()
    (folder / "sub").symlink_to(tmp_path / "target", target_is_directory=True)

    for external_id, code in (
        ("link.md", "symlink"),
        ("pipe.md", "special_file"),
        ("grown.md", "changed_while_reading"),
        ("sub/deep.md", "symlink"),
    ):
        with pytest.raises(DocumentUnreadable) as refused:
            await connector.fetch(items[external_id])
        assert refused.value.code == code, external_id
