"""The embedded runner against a real PostgreSQL: incremental sync, edits, deletions, bad input."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import docx
import pytest

from ragstream.connectors.base import SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream.core.vectors import TextKind, Vectors
from ragstream.embedding.local import LocalUSEEmbedder
from ragstream.jobs.sync import SyncReport
from ragstream.parsing import DOCX, PDF
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings
from tests.support.documents import pdf_with_text

pytestmark = pytest.mark.integration


async def sync(runtime: Runtime, folder: Path) -> SyncReport:
    return await runtime.pipeline().sync(FolderConnector(folder))


async def sources_for(runtime: Runtime, folder: Path, query: str) -> list[str]:
    """Sources of the results whose text contains the query's first word, best first.

    The vector leg always returns neighbours, so "found" means the text itself came back."""
    connection = FolderConnector(folder).connection_id
    response = await runtime.retriever.search(
        SearchRequest(query=query, filters=SearchFilters(connection_ids=[connection]))
    )
    term = query.split()[0].lower()
    return [result.source for result in response.results if term in result.text.lower()]


async def chunk_rows(runtime: Runtime, folder: Path) -> list[tuple[str, int]]:
    rows = await runtime.pool.fetch(
        "SELECT d.source, c.ordinal FROM chunks c JOIN documents d ON d.id = c.document_id"
        " WHERE d.connection_id = $1 ORDER BY 1, 2",
        FolderConnector(folder).connection_id,
    )
    return [(row["source"], row["ordinal"]) for row in rows]


async def test_sync_edit_delete_cycle(runtime: Runtime, corpus: Path) -> None:
    (corpus / "guide").mkdir()
    (corpus / "guide" / "falcon.md").write_text(
        "# Falcon deployment\n\n## Rollout\n\nThe quokkaflux rollout starts every Thursday at 09:30.\n"
    )
    (corpus / "notes.txt").write_text("Plain text notes about the zephyrine cache warmer.\n")
    (corpus / "page.html").write_text(
        "<html><head><title>Harbor page</title><script>var noise = 'scriptnoise';</script></head>"
        "<body><h1>Harbor</h1><p>The marzipanic gateway terminates TLS.</p></body></html>"
    )
    (corpus / "报销.md").write_text("# 报销制度\n\n## 时限\n\n报销单需在费用发生后三十天内提交。\n")

    first = await sync(runtime, corpus)
    assert first.ok, first.failures
    assert (first.progress.listed, first.progress.indexed, first.progress.unchanged) == (4, 4, 0)
    assert await sources_for(runtime, corpus, "quokkaflux rollout") == ["guide/falcon.md"]
    assert await sources_for(runtime, corpus, "zephyrine") == ["notes.txt"]
    assert (await sources_for(runtime, corpus, "marzipanic gateway"))[0] == "page.html"
    assert await sources_for(runtime, corpus, "scriptnoise") == []
    assert await sources_for(runtime, corpus, "报销单 什么时候提交") == ["报销.md"]

    again = await sync(runtime, corpus)
    assert (again.progress.unchanged, again.progress.indexed, again.progress.deleted) == (4, 0, 0)

    (corpus / "guide" / "falcon.md").write_text("# Falcon deployment\n\nThe glimmerwort rollout moved to Mondays.\n")
    (corpus / "notes.txt").unlink()
    edited = await sync(runtime, corpus)
    assert (edited.progress.indexed, edited.progress.deleted, edited.progress.unchanged) == (1, 1, 2)
    assert await sources_for(runtime, corpus, "glimmerwort") == ["guide/falcon.md"]
    assert "guide/falcon.md" not in await sources_for(runtime, corpus, "quokkaflux")
    assert await sources_for(runtime, corpus, "zephyrine") == []
    assert [source for source, _ in await chunk_rows(runtime, corpus)].count("notes.txt") == 0


async def test_touched_file_with_same_content_is_not_reindexed(runtime: Runtime, corpus: Path) -> None:
    document = corpus / "same.md"
    document.write_text("# Same\n\nUnchanged bytes.\n")
    assert (await sync(runtime, corpus)).progress.indexed == 1
    os.utime(document, ns=(1_000_000_000, 1_000_000_000))
    touched = await sync(runtime, corpus)
    assert (touched.progress.unchanged, touched.progress.indexed) == (1, 0)


async def test_bad_documents_fail_alone_with_their_reason(runtime: Runtime, corpus: Path) -> None:
    (corpus / "good.md").write_text("# Good\n\nThe xylocarp index still works.\n")
    (corpus / "latin1.md").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (corpus / "empty.md").write_text("  \n\n ")
    (corpus / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    with (corpus / "huge.md").open("wb") as huge:
        line = b"# Heading\n\n" + b"word " * 200 + b"\n\n"
        huge.write(line * (50 * 1024 * 1024 // len(line) + 1))
    nested = "".join(
        f"{'#' * (1 + level % 6)} Level {level}\n\ntext at depth {level} nestedterm\n\n" for level in range(300)
    )
    (corpus / "nested.md").write_text(nested)

    report = await sync(runtime, corpus)

    reasons = {failure.source: (failure.step, failure.code) for failure in report.failures}
    assert reasons == {
        "latin1.md": ("chunk", "invalid_utf8"),
        "empty.md": ("chunk", "empty"),
        "binary.txt": ("chunk", "binary"),
        "huge.md": ("fetch", "too_large"),
    }
    assert report.progress.indexed == 2
    assert await sources_for(runtime, corpus, "xylocarp") == ["good.md"]
    nested_chunks = await runtime.pool.fetch(
        "SELECT heading FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.source = 'nested.md'"
        " AND d.connection_id = $1",
        FolderConnector(corpus).connection_id,
    )
    assert nested_chunks and all(len(row["heading"]) <= 300 for row in nested_chunks)

    (corpus / "latin1.md").write_text("café crème, now in UTF-8")
    fixed = await sync(runtime, corpus)
    assert "latin1.md" not in {failure.source for failure in fixed.failures}


async def test_pdf_and_word_documents_are_indexed_with_their_sections(runtime: Runtime, corpus: Path) -> None:
    report_doc = docx.Document()
    report_doc.add_heading("Expense policy", level=1)
    report_doc.add_heading("Hotels", level=2)
    report_doc.add_paragraph("A hotel night is refunded up to the quillwort limit.")
    report_doc.save(corpus / "policy.docx")
    (corpus / "harbor.pdf").write_bytes(pdf_with_text("The marrowfat gateway\nlistens on port 7411.", title="Harbor"))
    (corpus / "broken.pdf").write_bytes(b"%PDF-1.4 and then nothing")

    report = await sync(runtime, corpus)

    assert {failure.source: failure.code for failure in report.failures} == {"broken.pdf": "malformed"}
    assert await sources_for(runtime, corpus, "quillwort limit") == ["policy.docx"]
    assert await sources_for(runtime, corpus, "marrowfat gateway") == ["harbor.pdf"]
    rows = await runtime.pool.fetch(
        "SELECT d.source, d.title, d.media_type, c.heading FROM chunks c JOIN documents d ON d.id = c.document_id"
        " WHERE d.connection_id = $1 ORDER BY 1",
        FolderConnector(corpus).connection_id,
    )
    assert [tuple(row) for row in rows] == [
        ("harbor.pdf", "Harbor", PDF, "Harbor"),  # a PDF has no headings: its title stands in
        ("policy.docx", "Expense policy", DOCX, "Expense policy"),
    ]


class VanishingFolder(FolderConnector):
    """Deletes one file after listing it, as a user might in the middle of a sync."""

    def __init__(self, root: Path, victim: str) -> None:
        super().__init__(root)
        self._victim = victim

    async def list_items(self) -> AsyncIterator[SourceItem]:
        async for item in super().list_items():
            if item.external_id == self._victim:
                (self.root / self._victim).unlink()
            yield item


async def test_file_deleted_mid_sync_is_treated_as_deleted(runtime: Runtime, corpus: Path) -> None:
    for name in ("a.md", "b.md", "c.md"):
        (corpus / name).write_text(f"# {name}\n\nversion one of {name} with term vanishterm\n")
    assert (await sync(runtime, corpus)).progress.indexed == 3
    for name in ("a.md", "b.md", "c.md"):
        (corpus / name).write_text(f"# {name}\n\nversion two of {name} with term vanishterm\n")

    report = await runtime.pipeline().sync(VanishingFolder(corpus, "b.md"))

    assert report.ok
    assert (report.progress.indexed, report.progress.deleted) == (2, 1)
    assert sorted(await sources_for(runtime, corpus, "vanishterm")) == ["a.md", "c.md"]


async def test_redelivered_and_reordered_versions_never_duplicate_chunks(runtime: Runtime, corpus: Path) -> None:
    (corpus / "doc.md").write_text("# Doc\n\n" + "A sentence about idempotency. " * 200)
    report = await sync(runtime, corpus)
    before = await chunk_rows(runtime, corpus)
    assert report.ok and len(before) > 1

    stored = await runtime.pool.fetchrow(
        "SELECT id, version FROM documents WHERE connection_id = $1", FolderConnector(corpus).connection_id
    )
    content = await runtime.store.load_staged(stored["version"])
    assert content is not None
    # Re-run the committed version through every stage, as a redelivery after a crash would.
    from ragstream.messages import DocumentChanged

    header = await runtime.pool.fetchrow("SELECT * FROM documents WHERE id = $1", stored["id"])
    message = DocumentChanged.model_validate(
        {
            "header": {
                "document_id": header["id"],
                "connection_id": header["connection_id"],
                "external_id": header["external_id"],
                "version": header["version"],
                "content_hash": header["content_hash"],
                "title": header["title"],
                "source": header["source"],
                "media_type": header["media_type"],
            }
        }
    )
    assert await runtime.chunker.run(message) == []
    older = message.model_copy(update={"header": message.header.model_copy(update={"version": 1})})
    assert await runtime.chunker.run(older) == []
    assert await chunk_rows(runtime, corpus) == before


def _section(heading: str, word: str) -> str:
    """A section of about 1,100 characters: one chunk of its own under the default 1,500-character size."""
    sentence = f"The {word} procedure keeps the {heading.lower()} steps in order and records each one. "
    return f"## {heading}\n\n" + sentence * (1100 // len(sentence)) + "\n\n"


async def _vectors_by_text(runtime: Runtime, folder: Path) -> dict[str, list[float]]:
    table = (await runtime.spaces.current()).table
    rows = await runtime.pool.fetch(
        f'SELECT c.text, e.embedding FROM chunks c JOIN documents d ON d.id = c.document_id JOIN "{table}" e'
        " ON e.chunk_id = c.id WHERE d.connection_id = $1",
        FolderConnector(folder).connection_id,
    )
    return {row["text"]: row["embedding"].to_list() for row in rows}


async def test_an_edited_document_embeds_only_its_changed_chunks(
    runtime: Runtime, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedded: list[str] = []
    embed = runtime.embedder.embed

    async def counting(texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        embedded.extend(texts)
        return await embed(texts, kind)

    monkeypatch.setattr(runtime.embedder, "embed", counting)
    page = corpus / "runbook.md"
    sections = [_section(name, word) for name, word in [("Backup", "quillmoss"), ("Restore", "tansyvale")]]
    page.write_text("# Runbook\n\n" + "".join(sections) + _section("Failover", "orrisglen"))
    first = await sync(runtime, corpus)
    assert first.ok, first.failures
    chunks = first.progress.chunks
    assert len(embedded) == chunks >= 3
    before = await _vectors_by_text(runtime, corpus)

    embedded.clear()
    page.write_text("# Runbook\n\n" + "".join(sections) + _section("Failover", "brackenfall"))
    edited = await sync(runtime, corpus)
    assert (edited.progress.indexed, edited.progress.chunks) == (1, chunks)
    assert len(embedded) == 1 and "brackenfall" in embedded[0]
    after = await _vectors_by_text(runtime, corpus)
    kept = [text for text in before if text in after]
    assert len(kept) == chunks - 1
    assert all(after[text] == before[text] for text in kept)
    assert await sources_for(runtime, corpus, "brackenfall procedure") == ["runbook.md"]
    assert await sources_for(runtime, corpus, "orrisglen procedure") == []
    assert await sources_for(runtime, corpus, "tansyvale procedure") == ["runbook.md"]


async def test_an_unchanged_resync_never_loads_the_local_model(
    database_url: str, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (corpus / "note.md").write_text("# Note\n\nThe heliotrope cache is warmed at dawn.\n")
    settings = Settings(database_url=database_url)
    async with open_runtime(settings, database_url) as runtime:
        assert (await sync(runtime, corpus)).progress.indexed == 1
    loads: list[LocalUSEEmbedder] = []
    load = LocalUSEEmbedder._load

    def counting(self: LocalUSEEmbedder) -> Any:
        loads.append(self)
        return load(self)

    monkeypatch.setattr(LocalUSEEmbedder, "_load", counting)
    async with open_runtime(settings, database_url) as fresh:
        again = await sync(fresh, corpus)
    assert (again.progress.unchanged, again.progress.indexed) == (1, 0)
    assert loads == []


async def test_a_changed_document_starts_loading_the_model_as_it_is_announced(
    database_url: str, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The load (seconds for the local model) then overlaps parsing and chunking; unchanged, none starts.
    note = corpus / "note.md"
    note.write_text("# Note\n\nThe marigold lantern is lit at dusk.\n")
    settings = Settings(database_url=database_url)
    async with open_runtime(settings, database_url) as runtime:
        assert (await sync(runtime, corpus)).progress.indexed == 1
    warm_ups: list[LocalUSEEmbedder] = []
    warm_up = LocalUSEEmbedder.warm_up

    async def counting(self: LocalUSEEmbedder) -> None:
        warm_ups.append(self)
        await warm_up(self)

    monkeypatch.setattr(LocalUSEEmbedder, "warm_up", counting)
    async with open_runtime(settings, database_url) as fresh:
        assert (await sync(fresh, corpus)).progress.unchanged == 1
        assert warm_ups == []
        note.write_text("# Note\n\nThe marigold lantern is lit at dusk and put out at dawn.\n")
        assert (await sync(fresh, corpus)).progress.indexed == 1
    assert len(warm_ups) == 1
