"""Parsing decides per document whether it is readable; every rejection carries a reason code."""

from __future__ import annotations

import io

import docx
import pytest
from pypdf import PdfWriter

from ragstream.parsing import DOCX, PDF, ParseError, ParseErrorCode, Parser, media_type_for, unwrap_lines
from tests.support.documents import docx_bytes, pdf_with_text


@pytest.mark.parametrize(
    ("content", "media_type", "code"),
    [
        (b"", "text/markdown", ParseErrorCode.EMPTY),
        (b" \n\t\n", "text/plain", ParseErrorCode.EMPTY),
        ("caf\xe9".encode("latin-1"), "text/markdown", ParseErrorCode.INVALID_UTF8),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "text/markdown", ParseErrorCode.BINARY),
        (b"x" * 101, "text/markdown", ParseErrorCode.TOO_LARGE),
        (b"<html><head><title>t</title></head><body></body></html>", "text/html", ParseErrorCode.EMPTY),
        (b"%PDF-1.7 cut short", PDF, ParseErrorCode.MALFORMED),
        (b"PK\x03\x04 not really a zip", DOCX, ParseErrorCode.MALFORMED),
        (b"{\\rtf1 old Word}", "application/rtf", ParseErrorCode.UNSUPPORTED),
    ],
)
def test_unreadable_documents_are_rejected_with_a_reason(content: bytes, media_type: str, code: str) -> None:
    with pytest.raises(ParseError) as raised:
        Parser(max_bytes=100).run(content, media_type, "fallback")
    assert raised.value.code == code


def test_markdown_title_comes_from_the_first_h1() -> None:
    parsed = Parser().run("\ufeffintro\r\n# 标题 #\r\nbody".encode(), "text/markdown", "file")
    assert parsed.title == "标题"
    assert "\r" not in parsed.markdown


def test_html_becomes_markdown_without_scripts_or_navigation() -> None:
    html = (
        b"<html><head><title>Harbor  guide</title><style>p{}</style></head><body><nav>menu</nav>"
        b"<h1>Harbor</h1><script>alert('x')</script><h2>Ports</h2><p>Port <b>7411</b>.</p></body></html>"
    )
    parsed = Parser().run(html, "text/html", "page")
    assert parsed.title == "Harbor guide"
    assert "# Harbor" in parsed.markdown and "## Ports" in parsed.markdown and "**7411**" in parsed.markdown
    assert "alert" not in parsed.markdown and "menu" not in parsed.markdown


def test_plain_text_keeps_the_file_name_as_title() -> None:
    assert Parser().run(b"just text", "text/plain", "notes").title == "notes"


def test_pdf_text_of_every_page_with_its_title() -> None:
    parsed = Parser().run(
        pdf_with_text("Harbor guide\nThe gateway listens\non port 7411.", "Rotate keys yearly.", title="Harbor"),
        PDF,
        "harbor.pdf",
    )
    assert parsed.title == "Harbor"
    # Layout line breaks inside a paragraph become spaces; pages become paragraphs.
    assert "The gateway listens on port 7411." in parsed.markdown
    assert parsed.markdown.endswith("\n\nRotate keys yearly.")
    assert Parser().run(pdf_with_text("No title here."), PDF, "fallback.pdf").title == "fallback.pdf"


def test_pdf_without_text_or_with_a_password_is_rejected_with_its_reason() -> None:
    blank = PdfWriter()
    blank.add_blank_page(612, 792)
    out = io.BytesIO()
    blank.write(out)
    with pytest.raises(ParseError, match="no text layer") as empty:
        Parser().run(out.getvalue(), PDF, "scan.pdf")
    assert empty.value.code == ParseErrorCode.EMPTY

    locked = PdfWriter(clone_from=io.BytesIO(pdf_with_text("Secret plans.")))
    locked.encrypt("hunter2", algorithm="AES-256")
    out = io.BytesIO()
    locked.write(out)
    with pytest.raises(ParseError) as encrypted:
        Parser().run(out.getvalue(), PDF, "locked.pdf")
    assert encrypted.value.code == ParseErrorCode.ENCRYPTED


def test_pdf_encrypted_only_against_editing_is_read() -> None:
    owner_only = PdfWriter(clone_from=io.BytesIO(pdf_with_text("Open to read.")))
    owner_only.encrypt(user_password="", owner_password="owner", algorithm="AES-128")
    out = io.BytesIO()
    owner_only.write(out)
    assert "Open to read." in Parser().run(out.getvalue(), PDF, "open.pdf").markdown


def test_pdf_line_breaks_between_cjk_characters_take_no_space() -> None:
    text = "报销单需在费用\n发生后三十天内提交。\nSee form\nA-7.\n\n下一段"
    assert unwrap_lines(text) == "报销单需在费用发生后三十天内提交。 See form A-7.\n\n下一段"


def test_docx_headings_lists_and_tables_become_markdown() -> None:
    document = docx.Document()
    document.core_properties.title = "报销制度"
    document.add_heading("报销制度", level=1)
    document.add_paragraph("报销单需在费用发生后三十天内提交。")
    document.add_heading("Limits", level=2)
    document.add_paragraph("Taxis are refunded", style="List Bullet")
    table = document.add_table(rows=2, cols=2)
    for row, values in zip(table.rows, (("Item", "Limit"), ("Hotel", "800 | night")), strict=True):
        for cell, value in zip(row.cells, values, strict=True):
            cell.text = value
    document.add_paragraph("")
    parsed = Parser().run(docx_bytes(document), DOCX, "policy.docx")
    assert parsed.title == "报销制度"
    assert parsed.markdown == (
        "# 报销制度\n\n报销单需在费用发生后三十天内提交。\n\n## Limits\n\n- Taxis are refunded\n\n"
        "| Item | Limit |\n| --- | --- |\n| Hotel | 800 \\| night |"
    )
    untitled = docx.Document()
    untitled.add_paragraph("   ")
    with pytest.raises(ParseError) as empty:
        Parser().run(docx_bytes(untitled), DOCX, "blank.docx")
    assert empty.value.code == ParseErrorCode.EMPTY


@pytest.mark.parametrize(
    ("name", "media_type"),
    [
        ("a.md", "text/markdown"),
        ("B.MARKDOWN", "text/markdown"),
        ("c.txt", "text/plain"),
        ("d.htm", "text/html"),
        ("e.PDF", PDF),
        ("f.docx", DOCX),
    ],
)
def test_media_types_by_extension(name: str, media_type: str) -> None:
    assert media_type_for(name) == media_type


@pytest.mark.parametrize("name", ["image.png", "noextension", "archive.tar.gz", "old.doc"])
def test_other_files_are_not_read(name: str) -> None:
    assert media_type_for(name) is None


def test_html_keeps_the_text_and_drops_the_page_chrome() -> None:
    html = (
        b'<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n'
        b"<!DOCTYPE html><?xml-stylesheet href='a'?><html><body><header>site header</header>"
        b"<template>hidden template</template><svg><text>svg label</text></svg><!-- a comment -->"
        b"<h2>Steps</h2><ul><li>first step</li></ul><table><tr><th>Key</th></tr><tr><td>value</td></tr></table>"
        b"<pre><code>run --fast</code></pre><footer>site footer</footer></body></html>"
    )
    markdown = Parser().run(html, "text/html", "page").markdown
    for noise in ("site header", "hidden template", "svg label", "a comment", "site footer", "DOCTYPE", "xml", "UTF-8"):
        assert noise not in markdown
    assert "## Steps" in markdown and "* first step" in markdown and "| Key |" in markdown and "run --fast" in markdown


def test_html_of_unclosed_tags_parses_in_linear_time() -> None:
    # Python's html.parser is quadratic on these (minutes at this size); lxml is not.
    page = "<p>The lentil page.</p>" + "<a " * 50_000 + "<!--" * 50_000
    assert "lentil" in Parser().run(page.encode(), "text/html", "page").markdown


@pytest.mark.parametrize("media_type", [PDF, DOCX, "text/markdown"])
def test_zero_bytes_are_empty_whatever_the_type(media_type: str) -> None:
    with pytest.raises(ParseError) as empty:
        Parser().run(b"", media_type, "nothing")
    assert empty.value.code == ParseErrorCode.EMPTY


def test_nul_and_lone_surrogates_are_removed_from_the_text_and_title() -> None:
    # A NUL in the first 8 KiB means a binary file; one further on is removed.
    late_nul = b"# Title\n\n" + b"words " * 2000 + b"\x00tail"
    parsed = Parser().run(late_nul, "text/markdown", "fallback")
    assert parsed.title == "Title" and "\x00" not in parsed.markdown and parsed.markdown.endswith("words tail")
    assert Parser().run(b"text", "text/plain", "name\ud800\x00.txt").title == "name.txt"


def test_text_past_the_limit_once_parsed_is_too_large() -> None:
    document = docx.Document()
    for number in range(3000):
        document.add_paragraph(f"paragraph {number}")
    content = docx_bytes(document)
    assert len(Parser().run(content, DOCX, "long.docx").markdown) > len(content)
    with pytest.raises(ParseError, match="characters is over the limit") as large:
        Parser(len(content), max_unpacked_bytes=10 << 20).run(content, DOCX, "long.docx")
    assert large.value.code == ParseErrorCode.TOO_LARGE


def test_a_word_package_that_inflates_past_the_limit_is_too_large() -> None:
    document = docx.Document()
    document.add_paragraph("Fine on its own.")
    content = docx_bytes(document)
    assert Parser().run(content, DOCX, "ok.docx").markdown == "Fine on its own."
    with pytest.raises(ParseError, match="inflates to") as large:
        Parser(max_unpacked_bytes=10_000).run(content, DOCX, "ok.docx")
    assert large.value.code == ParseErrorCode.TOO_LARGE


@pytest.mark.parametrize(
    ("markdown", "title"),
    [
        ("# C# tips #\n", "C# tips"),
        ("#NoSpace\n\n# Real one\n", "Real one"),
        ("##  Sub\n", "fallback"),
        ("#\n", "fallback"),
    ],
)
def test_markdown_title_is_the_first_h1_line(markdown: str, title: str) -> None:
    assert Parser().run(markdown.encode(), "text/markdown", "fallback").title == title
