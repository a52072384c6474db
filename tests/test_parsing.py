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
    # Python's html.parser is quadratic on these (minutes at this size); the converter is not, nor are
    # the passes over the raw page for the title and the elements to drop.
    page = "<p>The lentil page.</p>" + "<a " * 50_000 + "<!--" * 50_000 + "<table summary=" * 50_000
    page += "<title " * 50_000 + "<nav " * 50_000
    assert "lentil" in Parser().run(page.encode(), "text/html", "page").markdown


def test_deeply_nested_html_keeps_its_text_and_does_not_crash() -> None:
    # A tree walk in Python fails here with a RecursionError; the converter stops at its depth limit.
    page = "<p>The sorrel page.</p>" + "<div>" * 100_000 + "deep" + "</div>" * 100_000
    assert "sorrel" in Parser().run(page.encode(), "text/html", "page").markdown


@pytest.mark.parametrize(
    ("head", "title"),
    [
        ("<title>\n  Ports &amp;\tgates\n</title>", "Ports & gates"),
        ("<TITLE lang='en'>Ports</TITLE>", "Ports"),
        ("<title></title>", "Harbor"),
        ("", "Harbor"),
    ],
)
def test_html_title_comes_from_the_title_element_else_the_first_h1(head: str, title: str) -> None:
    page = f"<html><head>{head}</head><body><h2>Intro</h2><h1>Harbor</h1><p>Port 7411.</p></body></html>"
    parsed = Parser().run(page.encode(), "text/html", "page")
    assert parsed.title == title
    assert "Ports" not in parsed.markdown


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


DOCBOOK_PAGE = (
    b'<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n'
    b'<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN" "x.dtd"><html><head><title>CREATE TABLE</title>'
    b'<link rel="next" href="b.html" title="CREATE TABLE AS" /></head><body><div class="navheader">'
    b'<table summary="Navigation header"><tr><th colspan="5">CREATE TABLE</th></tr><tr><td><a href="a.html">Prev</a>'
    b'</td><th>SQL Commands</th><td><a href="b.html">Next</a></td></tr></table><hr /></div>'
    b'<div class="refentry"><h2>CREATE TABLE</h2><p>CREATE TABLE &#8212; define a new table</p>'
    b'<h2>See Also</h2><p><a class="xref" href="sql-altertable.html" title="ALTER TABLE">ALTER TABLE</a>, see '
    b'<a href="https://en.wikipedia.org/wiki/Table_(database)">tables</a>.<img src="figure-1.png" alt="figure" /></p>'
    b'</div><div class="navfooter"><hr /><table summary="Navigation footer"><tr><td><a href="a.html">Prev</a></td>'
    b'<td><a href="index.html" title="PostgreSQL 15.20 Documentation">Home</a></td></tr></table></div></body></html>'
)


def test_docbook_navigation_tables_and_rules_are_dropped() -> None:
    parsed = Parser().run(DOCBOOK_PAGE, "text/html", "page")
    assert parsed.title == "CREATE TABLE"
    assert parsed.markdown.startswith("## CREATE TABLE\n\nCREATE TABLE — define a new table")
    for noise in ("Prev", "Next", "Home", "SQL Commands", "---", "| ", "<?xml", "DOCTYPE", "dtd"):
        assert noise not in parsed.markdown
    # The page title is said once, by its own heading, not again by the navigation header.
    assert parsed.markdown.count("CREATE TABLE") == 2


def test_html_links_keep_their_text_and_drop_their_targets_and_images() -> None:
    markdown = Parser().run(DOCBOOK_PAGE, "text/html", "page").markdown
    assert "ALTER TABLE, see tables." in markdown
    for target in ("sql-altertable.html", "wikipedia", "](", '"ALTER TABLE"', "figure", ".png"):
        assert target not in markdown


@pytest.mark.parametrize(
    "chrome",
    [
        '<div role="navigation">Chapter list</div>',
        '<div class="related"><ul><li>modules</li><li>Chapter list</li></ul></div>',
        '<div class="sphinxsidebar">Chapter list</div>',
        '<ol class="breadcrumb"><li>Chapter list</li></ol>',
        '<a class="skip-link" href="#main">Chapter list</a>',
        '<ul class="nav breadcrumbs"><li>Chapter list</li></ul>',
        '<div class="navheader">Chapter list</div>',
        '<div class="navfooter">Chapter list</div>',
        '<table summary="Navigation footer"><tr><td>Chapter list</td></tr></table>',
        '<TABLE class="x" SUMMARY="  NAVIGATION header"><tr><td>Chapter list</td></tr></TABLE>',
        "<table summary=navigation><tr><td>Chapter list</td></tr></table>",
        "<aside>Chapter list</aside>",
        "<noscript>Chapter list</noscript>",
        # HTML 4 pages write their tags in upper case.
        "<NAV>Chapter list</NAV><HR>",
        "<Aside>Chapter list</Aside><HEADER>Chapter list</HEADER><FOOTER>Chapter list</FOOTER>",
    ],
)
def test_generated_site_navigation_is_dropped(chrome: str) -> None:
    anchor = "<a class='headerlink' href='#p'>\u00b6</a>"
    page = f"<html><body>{chrome}<h1>Ports{anchor}</h1><p>Port 7411.</p></body></html>"
    markdown = Parser().run(page.encode(), "text/html", "page").markdown
    assert markdown == "# Ports\n\nPort 7411."


def test_html_that_only_looks_like_navigation_is_kept() -> None:
    page = (
        b"<html><body><table summary='Navigational aids'><tr><td>aids</td></tr></table>"
        b"<table summary='Settings, navigation'><tr><td>settings</td></tr></table>"
        b"<div class='navheaders'>headers</div><div role='main'>main</div><p data-summary='navigation'>para</p>"
        b"<header-note>note</header-note></body></html>"
    )
    markdown = Parser().run(page, "text/html", "page").markdown
    for kept in ("aids", "settings", "headers", "main", "para", "note"):
        assert kept in markdown


def test_html_keeps_lists_tables_of_contents_tables_and_code() -> None:
    page = (
        b"<html><body><div class='toc'><p><b>Table of Contents</b></p><dl><dt>1. Getting Started</dt>"
        b"<dt>2. The SQL Language</dt></dl></div><ol><li>install</li><li>run</li></ol>"
        b"<table summary='Settings'><tr><th>Name</th><th>Default</th></tr><tr><td>port</td><td>5432</td></tr></table>"
        b"<pre>SELECT 1;\n  -- indented</pre><p>Use <code>psql</code>.</p></body></html>"
    )
    markdown = Parser().run(page, "text/html", "page").markdown
    for kept in ("Table of Contents", "1. Getting Started", "2. The SQL Language", "1. install", "2. run"):
        assert kept in markdown
    assert "| Name | Default |" in markdown and "| port | 5432 |" in markdown
    assert "```\nSELECT 1;\n  -- indented\n```" in markdown and "Use `psql`." in markdown


def test_markdown_links_and_images_lose_their_targets_outside_code() -> None:
    source = (
        "# Guide\n\n"
        'See [the install page](install.md "Install") and [RFC](https://en.wikipedia.org/wiki/RFC_(x)).\n'
        '![diagram](img/arch.png) Logo: <img src="logo.svg" alt="logo"> and [the FAQ][faq].\n'
        "Keep `[not](a-link)` as code.\n\n"
        '[faq]: https://example.com/faq "FAQ"\n\n'
        "```md\n[in a fence](stays.md)\n```\n"
    )
    markdown = Parser().run(source.encode(), "text/markdown", "guide").markdown
    assert "See the install page and RFC.\n" in markdown
    assert " Logo:  and the FAQ.\n" in markdown
    assert "Keep `[not](a-link)` as code." in markdown and "[in a fence](stays.md)" in markdown
    for target in ("install.md", "wikipedia", "arch.png", "logo.svg", "example.com", "[faq]"):
        assert target not in markdown


def test_markdown_cleaning_is_linear_on_unclosed_brackets() -> None:
    # Each bracket scans a bounded distance: a 1 MB line of unclosed links is a quick parse.
    line = "[a](b " * 200_000
    assert Parser().run(line.encode(), "text/markdown", "brackets").markdown == line
