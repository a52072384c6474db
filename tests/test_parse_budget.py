"""Bad input fails alone: decompression bombs, parses over their time or memory budget, text PostgreSQL
cannot store. The bombs are built in the test, streamed, and small on disk."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import docx
import numpy as np
import pytest

from ragstream.connectors.folder import FolderConnector
from ragstream.failures import classify
from ragstream.messages import ChunkPayload, DocumentHeader
from ragstream.parsing import DOCX, ParseError, ParseErrorCode, Parser
from ragstream.parsing_pool import ParserPool
from ragstream.runtime import Runtime
from ragstream.storage.documents import document_id
from tests.support.documents import streamed_docx

pytestmark = pytest.mark.integration

_ZEROS = bytes(4 << 20)


async def test_bombs_and_unstorable_text_fail_alone_while_good_files_index(runtime: Runtime, corpus: Path) -> None:
    (corpus / "good.md").write_text("# Good\n\nThe xylocarp index still works.\n")
    good_docx = docx.Document()
    good_docx.add_paragraph("The quillwort memo is fine.")
    good_docx.save(corpus / "good.docx")
    # 1 MB on disk, 1 GiB inflated: the member's sizes give it away before anything inflates.
    streamed_docx(corpus / "zeros.docx", ["bait"], (_ZEROS for _ in range(256)))
    # 42 MB of identical paragraphs from 0.1 MB.
    streamed_docx(corpus / "paragraphs.docx", ("paragraph" for _ in range(1_000_000)))
    # 1.6 MB of unclosed <script> tags, which a backtracking clean-up regex takes hours over.
    (corpus / "scripts.html").write_text("<html><body><p>The fenugreek page.</p>" + "<script>" * 200_000)
    # A NUL past the first 8 KiB, which the binary check does not look at: removed, not stored.
    (corpus / "late-nul.md").write_text("# Late NUL\n\n" + "filler words here. " * 500 + "\x00 the rutabaga line\n")
    (corpus / "empty.pdf").write_bytes(b"")
    (corpus / "empty.docx").write_bytes(b"")

    report = await runtime.pipeline().sync(FolderConnector(corpus))

    reasons = {failure.source: (failure.step, failure.code, failure.retryable) for failure in report.failures}
    assert reasons == {
        "zeros.docx": ("chunk", "too_large", False),
        "paragraphs.docx": ("chunk", "too_large", False),
        "empty.pdf": ("chunk", "empty", False),
        "empty.docx": ("chunk", "empty", False),
    }
    assert "decompression bomb" in next(f.message for f in report.failures if f.source == "zeros.docx")
    rows = await runtime.pool.fetch(
        "SELECT d.source, c.text FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1",
        FolderConnector(corpus).connection_id,
    )
    texts = {row["source"]: row["text"] for row in rows}
    assert set(texts) == {"good.md", "good.docx", "scripts.html", "late-nul.md"}
    assert "fenugreek" in texts["scripts.html"]
    late = " ".join(row["text"] for row in rows if row["source"] == "late-nul.md")
    assert "rutabaga" in late and "\x00" not in late


async def test_a_parse_over_its_time_fails_alone_and_the_pool_goes_on(tmp_path: Path) -> None:
    # 400,000 paragraphs take the parser many seconds; the budget is half of one.
    streamed_docx(tmp_path / "slow.docx", (f"paragraph {number}" for number in range(400_000)))
    pool = ParserPool(Parser(), workers=1, timeout_s=0.5)
    try:
        with pytest.raises(ParseError) as slow:
            await pool.run((tmp_path / "slow.docx").read_bytes(), DOCX, "slow.docx")
        assert slow.value.code == ParseErrorCode.PARSE_TIMEOUT
        assert (await pool.run(b"# Next\n\nparsed by a new worker", "text/markdown", "next.md")).title == "Next"
    finally:
        await pool.aclose()


async def test_a_parse_over_its_memory_fails_alone_and_the_pool_goes_on(tmp_path: Path) -> None:
    # 40 MB of distinct paragraphs, under the size and ratio limits: its XML tree needs far more than
    # the worker's 256 MiB.
    streamed_docx(tmp_path / "big.docx", (f"paragraph number {number} of many" for number in range(1_000_000)))
    pool = ParserPool(Parser(64 << 20, 512 << 20), workers=1, memory_mb=256)
    try:
        with pytest.raises(ParseError) as big:
            await pool.run((tmp_path / "big.docx").read_bytes(), DOCX, "big.docx")
        assert big.value.code == ParseErrorCode.PARSE_MEMORY
        assert (await pool.run(b"# Next\n\nparsed by a new worker", "text/markdown", "next.md")).title == "Next"
    finally:
        await pool.aclose()


async def test_html_over_its_memory_fails_alone_and_the_pool_goes_on() -> None:
    # 20 MB of table cells: the converter's tree of them needs far more than the worker's 256 MiB, and
    # its failed allocation aborts the worker (Rust code) instead of raising MemoryError.
    page = ("<table>" + "<tr><td>a</td><td>b</td></tr>" * 700_000 + "</table>").encode()
    pool = ParserPool(Parser(64 << 20), workers=1, memory_mb=256)
    try:
        with pytest.raises(ParseError) as big:
            await pool.run(page, "text/html", "big.html")
        assert big.value.code == ParseErrorCode.PARSE_MEMORY
        assert (await pool.run(b"# Next\n\nparsed by a new worker", "text/markdown", "next.md")).title == "Next"
    finally:
        await pool.aclose()


def parser_workers() -> set[int]:
    """Process ids of this process's parser workers (the session runtime's included)."""
    workers = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            command = (status.parent / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        if int(fields["PPid"]) == os.getpid() and b"ragstream.parsing_pool" in command:
            workers.add(int(status.parent.name))
    return workers


async def test_a_closed_pool_stops_its_workers_and_refuses_work() -> None:
    before = parser_workers()
    pool = ParserPool(Parser(), workers=2)
    assert (await pool.run(b"warm", "text/plain", "a.txt")).markdown == "warm"
    started = parser_workers() - before
    assert len(started) == 1  # the warm worker took the second document too
    assert (await pool.run(b"again", "text/plain", "b.txt")).markdown == "again"
    assert parser_workers() - before == started
    await pool.aclose()
    assert not parser_workers() & started
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(b"late", "text/plain", "c.txt")


async def test_unstorable_text_that_reaches_the_index_step_is_a_permanent_failure(runtime: Runtime) -> None:
    connection_id = f"folder-{uuid.uuid4().hex[:12]}"
    await runtime.store.ensure_connection(connection_id, "folder", connection_id)
    header = DocumentHeader(
        document_id=document_id(connection_id, "nul.md"),
        connection_id=connection_id,
        external_id="nul.md",
        version=await runtime.store.next_version(),
        content_hash="nul",
        title="NUL",
        source="nul.md",
        media_type="text/markdown",
    )
    chunks = [ChunkPayload(ordinal=0, heading="", text="a\x00b")]
    vectors = np.zeros((1, runtime.embedder.dimension), dtype=np.float32)
    with pytest.raises(Exception) as raised:
        await runtime.store.commit_document(header, chunks, vectors, runtime.embedder.model_key)
    assert raised.type.__module__.startswith("asyncpg")
    failure = classify(raised.value)
    assert (failure.code, failure.retryable) == ("unstorable_text", False)


async def test_a_worker_that_cannot_start_is_a_retryable_error_not_the_documents() -> None:
    # 40 MiB cannot hold the parsing libraries: the worker dies importing them, before any document.
    pool = ParserPool(Parser(), workers=1, memory_mb=40)
    try:
        with pytest.raises(RuntimeError, match="failed to start") as raised:
            await pool.run(b"# Fine\n\ntext", "text/markdown", "fine.md")
        assert classify(raised.value).retryable
    finally:
        await pool.aclose()


async def test_a_run_cancelled_as_a_worker_frees_up_is_cancelled_and_leaves_the_worker() -> None:
    # The one worker is busy; a second run waits for it. The second is cancelled in the very loop turn
    # the first hands the worker back: it must raise, not go on to parse (Python 3.11's wait_for
    # returned the worker instead, and a task group waiting on that run hung).
    pool = ParserPool(Parser(), workers=1)
    try:
        first = asyncio.create_task(pool.run(b"first", "text/plain", "first.txt"))
        waiting = asyncio.create_task(pool.run(b"second", "text/plain", "second.txt"))
        first.add_done_callback(lambda _: waiting.cancel())
        assert (await first).markdown == "first"
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await pool.run(b"third", "text/plain", "third.txt")).markdown == "third"
    finally:
        await pool.aclose()
