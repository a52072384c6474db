"""Parsing decides per document whether it is readable; every rejection carries a reason code."""

from __future__ import annotations

import pytest

from ragstream.parsing import ParseError, ParseErrorCode, Parser, media_type_for


@pytest.mark.parametrize(
    ("content", "media_type", "code"),
    [
        (b"", "text/markdown", ParseErrorCode.EMPTY),
        (b" \n\t\n", "text/plain", ParseErrorCode.EMPTY),
        ("caf\xe9".encode("latin-1"), "text/markdown", ParseErrorCode.INVALID_UTF8),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "text/markdown", ParseErrorCode.BINARY),
        (b"x" * 101, "text/markdown", ParseErrorCode.TOO_LARGE),
        (b"<html><head><title>t</title></head><body></body></html>", "text/html", ParseErrorCode.EMPTY),
        (b"%PDF-1.7", "application/pdf", ParseErrorCode.UNSUPPORTED),
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


@pytest.mark.parametrize(
    ("name", "media_type"),
    [("a.md", "text/markdown"), ("B.MARKDOWN", "text/markdown"), ("c.txt", "text/plain"), ("d.htm", "text/html")],
)
def test_media_types_by_extension(name: str, media_type: str) -> None:
    assert media_type_for(name) == media_type


@pytest.mark.parametrize("name", ["image.png", "noextension", "archive.tar.gz"])
def test_other_files_are_not_read(name: str) -> None:
    assert media_type_for(name) is None
