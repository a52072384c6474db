"""Raw bytes to Markdown text: the one place that decides whether a document is readable at all."""

from __future__ import annotations

import functools
import html
import io
import re
import zipfile
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from ragstream.core.errors import DocumentError
from ragstream.core.storable import strip_unstorable

if TYPE_CHECKING:
    from html_to_markdown import ConversionOptions

__all__ = [
    "DOCX",
    "PDF",
    "ParseError",
    "ParseErrorCode",
    "ParsedDocument",
    "Parser",
    "clean_markdown",
    "media_type_for",
    "unwrap_lines",
]

PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
_MEDIA_TYPES = {
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".txt": "text/plain",
    ".text": "text/plain",
    ".html": "text/html",
    ".htm": "text/html",
    ".pdf": PDF,
    ".docx": DOCX,
}
_CONTROL = re.compile(rb"[\x00-\x08\x0e-\x1f]")
# Not the page's text: code, the head, and the site's navigation, sidebars, headers and footers.
_HTML_NOISE = ("script", "style", "head", "nav", "noscript", "aside", "footer", "header", "template", "svg", "hr")
# Navigation that generators draw with plain divs and tables: DocBook's navheader/navfooter (Debian's
# documentation packages), Sphinx's related bar, sidebar and ¶ heading anchors, skip links and
# breadcrumbs. Elements with the ARIA role ``navigation`` or a DocBook navigation table summary go too.
_NAV_CLASSES = frozenset(
    {"navheader", "navfooter", "related", "sphinxsidebar", "headerlink", "skip-link", "breadcrumb", "breadcrumbs"}
)
# The noise elements and DocBook's navigation tables are dropped by a mark that this pass over the raw
# page puts on their start tags, not by the converter's selectors: those match a tag name in lower case
# only (HTML 4 pages often write upper case) and an attribute value in its exact case only, where a
# navigation table's summary ("Navigation header") is matched in any. A candidate is looked at no
# further than the end of its own tag, so the pass is linear in the page.
_HTML_DROPPED = re.compile(
    rf"<(?:{'|'.join(_HTML_NOISE)})(?=[\s/>])"
    r"|<table(?=[\s/])(?=[^<>]{0,2000}?[\s\"'/]summary\s*=\s*[\"']?\s*navigation\b)",
    re.IGNORECASE,
)
_DROP_MARK = "data-ragstream-drop"
_HTML_EXCLUDED = (f"[{_DROP_MARK}]", '[role="navigation"]', *sorted(f".{name}" for name in _NAV_CLASSES))
# The start of the first ``<title>`` tag, and the end of its text. Bounded, and searched for once each,
# so a page of unclosed tags costs one scan.
_HTML_TITLE = re.compile(r"<title(?=[\s/>])[^<>]{0,1000}>", re.IGNORECASE)
_HTML_TITLE_END = re.compile(r"</title", re.IGNORECASE)
# Markdown link and image syntax: ``![alt](url "title")``, ``[text](url)``, ``[text][ref]``, raw
# ``<img>`` tags and the ``[ref]: url`` definitions. Every repetition is bounded, so a line of
# unclosed brackets costs a constant per character, not a scan to the end of the line per bracket.
_MD_IMAGE = re.compile(
    r"!\[[^\]\n]{0,1000}\](?:\((?:[^()\n]|\([^()\n]{0,500}\)){0,2000}\)|\[[^\]\n]{0,500}\])|<img\b[^>\n]{0,2000}>",
    re.IGNORECASE,
)
_MD_LINK = re.compile(r"\[([^\]\n]{1,1000})\](?:\((?:[^()\n]|\([^()\n]{0,500}\)){0,2000}\)|\[[^\]\n]{0,500}\])")
_MD_DEFINITION = re.compile(r" {0,3}\[[^\]\n]{1,1000}\]:[ \t]*\S")
_MD_FENCE = re.compile(r"[ \t]{0,3}(```|~~~)")
_MD_INLINE_CODE = re.compile(r"`[^`\n]{0,2000}`")
# Members that inflate more than this many times their compressed size are a bomb, not a document:
# DEFLATE reaches about a thousand on a run of zeros, text and markup stay far below this.
_MAX_COMPRESSION_RATIO = 200
_RATIO_FLOOR = 1 << 20  # small members may compress as well as they like
_CJK = "\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_CJK_LINE_BREAK = re.compile(f"(?<=[{_CJK}])[ \t]*\n[ \t]*(?=[{_CJK}])")
_LINE_BREAK = re.compile(r"(?<=\S)[ \t]*\n[ \t]*(?=\S)")
_HEADING_STYLE = re.compile(r"^Heading ([1-6])$")


def media_type_for(name: str) -> str | None:
    """The media type a file name implies, or None when ragstream does not read that kind."""
    dot = name.rfind(".")
    return _MEDIA_TYPES.get(name[dot:].lower()) if dot >= 0 else None


class ParseErrorCode(StrEnum):
    EMPTY = "empty"
    TOO_LARGE = "too_large"
    BINARY = "binary"
    INVALID_UTF8 = "invalid_utf8"
    UNSUPPORTED = "unsupported_type"
    MALFORMED = "malformed"
    ENCRYPTED = "encrypted"
    PARSE_TIMEOUT = "parse_timeout"
    PARSE_MEMORY = "parse_memory"
    PARSE_CRASHED = "parse_crashed"


class ParseError(DocumentError):
    """A permanent, per-document reason why a document cannot be indexed; retrying will not help."""

    def __init__(self, code: ParseErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class ParsedDocument:
    title: str
    markdown: str


class Parser:
    """Decodes and normalises md, txt, html, pdf and docx; rejects what would index as garbage.

    Synchronous and CPU-bound (a long PDF takes seconds), and trusting its input to be no bomb: the
    pipeline runs it in worker processes with a time and memory budget (``ParserPool``). Each step
    here is linear in the input. ``max_bytes`` bounds the content and the parsed text (in characters),
    ``max_unpacked_bytes`` what a Word package may inflate to (default: 8 × ``max_bytes``, at most
    256 MiB). NUL characters and lone surrogates, which PostgreSQL cannot store, are removed from the
    text of every format (PDF text layers carry them from broken fonts).
    """

    def __init__(self, max_bytes: int = 16 * 1024 * 1024, max_unpacked_bytes: int | None = None) -> None:
        self._max_bytes = max_bytes
        self._max_unpacked = min(8 * max_bytes, 256 << 20) if max_unpacked_bytes is None else max_unpacked_bytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def max_unpacked_bytes(self) -> int:
        return self._max_unpacked

    def check_size(self, content: bytes) -> None:
        """``too_large`` when ``content`` is over the limit: checked before it is handed to a worker."""
        if len(content) > self._max_bytes:
            raise ParseError(ParseErrorCode.TOO_LARGE, f"{len(content)} bytes is over the limit of {self._max_bytes}")

    def run(self, content: bytes, media_type: str, fallback_title: str) -> ParsedDocument:
        self.check_size(content)
        if not content:
            raise ParseError(ParseErrorCode.EMPTY, "the file is empty")
        parsed = self._parse(content, media_type, strip_unstorable(fallback_title))
        markdown = strip_unstorable(parsed.markdown)
        if len(markdown) > self._max_bytes:
            raise ParseError(
                ParseErrorCode.TOO_LARGE,
                f"its text of {len(markdown)} characters is over the limit of {self._max_bytes}",
            )
        if not markdown.strip():
            raise ParseError(ParseErrorCode.EMPTY, "the document has no text")
        return ParsedDocument(strip_unstorable(parsed.title), markdown)

    def _parse(self, content: bytes, media_type: str, fallback_title: str) -> ParsedDocument:
        if media_type == PDF:
            return _from_pdf(content, fallback_title)
        if media_type == DOCX:
            _check_unpacked_size(content, self._max_unpacked)
            return _from_docx(content, fallback_title)
        text = self._decode(content)
        if not text.strip():
            raise ParseError(ParseErrorCode.EMPTY, "the document has no text")
        if media_type == "text/html":
            return self._from_html(text, fallback_title)
        if media_type == "text/markdown":
            markdown = clean_markdown(text)
            return ParsedDocument(_first_h1(markdown) or fallback_title, markdown)
        if media_type == "text/plain":
            return ParsedDocument(fallback_title, text)
        raise ParseError(ParseErrorCode.UNSUPPORTED, f"cannot parse {media_type}")

    @staticmethod
    def _decode(content: bytes) -> str:
        head = content[:8192]
        # A NUL byte or a run of control characters means a binary file behind a text extension;
        # decoding it would index noise that matches every query. A NUL further on is removed later.
        if b"\x00" in head or len(_CONTROL.findall(head)) > max(8, len(head) // 100):
            raise ParseError(ParseErrorCode.BINARY, "the file looks binary (control bytes in its first 8 KiB)")
        try:
            text = content.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise ParseError(
                ParseErrorCode.INVALID_UTF8, f"not valid UTF-8 at byte {error.start}: {error.reason}"
            ) from None
        return text.replace("\r\n", "\n").replace("\r", "\n")

    @staticmethod
    def _from_html(text: str, fallback_title: str) -> ParsedDocument:
        # Imported lazily: the converter is only for HTML sources.
        import html_to_markdown

        try:
            page = _HTML_DROPPED.sub(rf"\g<0> {_DROP_MARK} ", text)
            markdown = html_to_markdown.convert(page, _html_options()).content or ""
        except Exception as error:  # the converter's own errors (ConversionError, PanicError, ...) and MemoryError
            raise _unreadable(error, "HTML could not be converted") from error
        markdown = re.sub(r"\n{3,}", "\n\n", markdown).strip()
        if not markdown:
            raise ParseError(ParseErrorCode.EMPTY, "the HTML page has no text")
        return ParsedDocument(_html_title(text) or _first_h1(markdown) or fallback_title, markdown)


@functools.cache
def _html_options() -> ConversionOptions:
    """How html-to-markdown (a Rust parser and converter, linear in the page and some ten times faster
    than a Python tree walk) writes a page: the noise and navigation elements dropped with all they hold,
    and no text the page does not show a reader. Comments, the doctype and processing instructions
    (``<?xml``, as DocBook writes its XHTML pages) never reach the text. Elements nested deeper than
    its depth limit (1024) are left out, where a recursive walk would fail the whole page."""
    from html_to_markdown import ConversionOptions, PreprocessingOptions

    return ConversionOptions(
        heading_style="atx",
        bullets="*+-",
        # Column-aligning spaces are tokens of nothing to search by.
        compact_tables=True,
        # Links become their text and images nothing: a URL is many tokens of nothing to search by.
        strip_tags=["a"],
        skip_images=True,
        # Neither an <abbr>'s title nor a blockquote's cite URL is text the page shows.
        expand_abbreviations=False,
        include_blockquote_citations=False,
        # The title is read by _html_title: the metadata would come as YAML front matter in the text.
        extract_metadata=False,
        # Text hidden until the reader opens it (a closed tab, a collapsed section) is still the page's.
        hidden_content="reachable",
        # Off: the converter's own clean-up guesses, which drop the text of forms yet keep DocBook's navigation.
        preprocessing=PreprocessingOptions(enabled=False),
        exclude_selectors=list(_HTML_EXCLUDED),
    )


def _html_title(text: str) -> str:
    """The text of the page's first ``<title>``, entities decoded and whitespace collapsed, or ""."""
    start = _HTML_TITLE.search(text)
    end = _HTML_TITLE_END.search(text, start.end()) if start is not None else None
    if start is None or end is None:
        return ""
    return re.sub(r"\s+", " ", html.unescape(text[start.end() : end.start()])).strip()


def clean_markdown(markdown: str) -> str:
    """Markdown without link targets, images and link definitions; link text stays, and code (fenced
    blocks and inline spans) is left exactly as written."""
    lines: list[str] = []
    in_fence = False
    for line in markdown.split("\n"):
        if _MD_FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            if _MD_DEFINITION.match(line):
                continue
            line = _strip_links(line)
        lines.append(line)
    return "\n".join(lines)


def _strip_links(line: str) -> str:
    """One line's links and images removed outside its inline code spans."""
    if "[" not in line and "<" not in line:
        return line
    parts: list[str] = []
    last = 0
    for code in _MD_INLINE_CODE.finditer(line):
        parts.append(_MD_LINK.sub(r"\1", _MD_IMAGE.sub("", line[last : code.start()])))
        parts.append(code.group())
        last = code.end()
    parts.append(_MD_LINK.sub(r"\1", _MD_IMAGE.sub("", line[last:])))
    return "".join(parts)


def _unreadable(error: Exception, what: str) -> ParseError:
    """``malformed``, or ``parse_memory`` when the library ran out of memory: a ``MemoryError`` in the
    chain, or libxml2's ``ERR_NO_MEMORY``, which lxml reports as a syntax error."""
    cause: BaseException | None = error
    while cause is not None:
        log = getattr(cause, "error_log", None) or ()
        if isinstance(cause, MemoryError) or any(getattr(entry, "type_name", "") == "ERR_NO_MEMORY" for entry in log):
            return ParseError(ParseErrorCode.PARSE_MEMORY, f"{what}: it needs more memory than the parser may use")
        cause = cause.__cause__ or cause.__context__
    return ParseError(ParseErrorCode.MALFORMED, f"{what}: {error}")


def _first_h1(markdown: str) -> str:
    """The text of the first ``# heading`` line (its closing ``#`` run removed), or ""; a scan of the
    lines, linear where a multi-line regex can backtrack on a long line."""
    for line in markdown.split("\n"):
        if len(line) > 1 and line[0] == "#" and line[1] in " \t":
            title = line[1:].strip().rstrip("#").strip()
            if title:
                return title
    return ""


def _check_unpacked_size(content: bytes, limit: int) -> None:
    """``too_large`` for a zip package that inflates past ``limit`` bytes in all, or that has a member
    compressed suspiciously well; ``malformed`` for no zip at all. The sizes are the declared ones:
    zipfile never inflates a member past its declared size (and fails its CRC check instead)."""
    try:
        members = zipfile.ZipFile(io.BytesIO(content)).infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as error:
        raise ParseError(ParseErrorCode.MALFORMED, f"not a zip package: {error}") from error
    total = 0
    for member in members:
        total += member.file_size
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > _RATIO_FLOOR and ratio > _MAX_COMPRESSION_RATIO:
            raise ParseError(
                ParseErrorCode.TOO_LARGE,
                f"{member.filename} inflates {ratio:.0f} times (to {member.file_size} bytes): a decompression bomb",
            )
    if total > limit:
        raise ParseError(ParseErrorCode.TOO_LARGE, f"it inflates to {total} bytes, over the limit of {limit}")


def unwrap_lines(text: str) -> str:
    """Join the lines a PDF's layout broke a paragraph into: no space between two CJK characters
    (Chinese takes none, and a stray one would split its keyword bigrams), a space elsewhere.
    Blank lines, the paragraph breaks, stay."""
    return _LINE_BREAK.sub(" ", _CJK_LINE_BREAK.sub("", text))


def _from_pdf(content: bytes, fallback_title: str) -> ParsedDocument:
    """The text layer of every page; a scan without one is empty, not garbage from an OCR guess."""
    # Imported lazily, like the HTML converter: only PDF sources need pypdf.
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(content))
        # Many PDFs are encrypted only against editing, with an empty password to open them.
        if reader.is_encrypted and not reader.decrypt(""):
            raise ParseError(ParseErrorCode.ENCRYPTED, "the PDF needs a password to open")
        pages = [page.extract_text() or "" for page in reader.pages]
        title = str(reader.metadata.title or "").strip() if reader.metadata else ""
    except ParseError:
        raise
    except Exception as error:  # pypdf raises many types for broken files (PdfReadError, KeyError, ...)
        raise _unreadable(error, "the PDF could not be read") from error
    paragraphs = [unwrap_lines(page.strip()) for page in pages]
    markdown = re.sub(r"\n{3,}", "\n\n", "\n\n".join(text for text in paragraphs if text))
    if not markdown.strip():
        raise ParseError(ParseErrorCode.EMPTY, "the PDF has no text layer (a scan? run OCR on it first)")
    return ParsedDocument(title or fallback_title, markdown)


def _from_docx(content: bytes, fallback_title: str) -> ParsedDocument:
    """Paragraphs and tables in document order; Word's heading styles become Markdown headings, so
    chunks keep their section path."""
    import docx
    from docx.enum.style import WD_STYLE_TYPE
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(content))
        # Looked up once: python-docx's ``Paragraph.style`` scans every style of the document for each
        # paragraph, minutes for a long one.
        default_style = document.styles.default(WD_STYLE_TYPE.PARAGRAPH)
        default_name = default_style.name or "" if default_style is not None else ""
        style_names = {
            style.style_id: style.name or "" for style in document.styles if style.type == WD_STYLE_TYPE.PARAGRAPH
        }
        blocks: list[str] = []
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                rows = [[cell.text.strip().replace("|", "\\|") for cell in row.cells] for row in block.rows]
                if rows:
                    lines = ["| " + " | ".join(row) + " |" for row in rows]
                    lines.insert(1, "|" + " --- |" * len(rows[0]))
                    blocks.append("\n".join(lines))
                continue
            text = block.text.strip()
            if not text:
                continue
            style_id = block._p.style  # the paragraph's w:pStyle, None for the default style
            style = style_names.get(style_id, default_name) if style_id is not None else default_name
            level = _HEADING_STYLE.match(style)
            if style == "Title":
                blocks.append(f"# {text}")
            elif level:
                blocks.append(f"{'#' * int(level.group(1))} {text}")
            elif style.startswith("List"):
                blocks.append(f"- {text}")
            else:
                blocks.append(text)
        title = (document.core_properties.title or "").strip()
    except Exception as error:  # not a zip, not a Word package, a broken part: python-docx raises each its way
        raise _unreadable(error, "the Word document could not be read") from error
    markdown = "\n\n".join(blocks)
    if not markdown.strip():
        raise ParseError(ParseErrorCode.EMPTY, "the Word document has no text")
    return ParsedDocument(title or _first_h1(markdown) or fallback_title, markdown)
