"""Raw bytes to Markdown text: the one place that decides whether a document is readable at all."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DOCX", "PDF", "ParseError", "ParseErrorCode", "ParsedDocument", "Parser", "media_type_for", "unwrap_lines"]

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
_H1 = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.MULTILINE)
_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
# Not the page's text: code, the head, and the site's navigation, sidebars and footers.
_HTML_NOISE = re.compile(
    r"<(script|style|head|nav|noscript|aside|footer)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL
)
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


class ParseError(Exception):
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

    Synchronous and CPU-bound (a long PDF takes seconds): async callers run it in a thread.
    """

    def __init__(self, max_bytes: int = 16 * 1024 * 1024) -> None:
        self._max_bytes = max_bytes

    def run(self, content: bytes, media_type: str, fallback_title: str) -> ParsedDocument:
        if len(content) > self._max_bytes:
            raise ParseError(ParseErrorCode.TOO_LARGE, f"{len(content)} bytes is over the limit of {self._max_bytes}")
        if media_type == PDF:
            return _from_pdf(content, fallback_title)
        if media_type == DOCX:
            return _from_docx(content, fallback_title)
        text = self._decode(content)
        if not text.strip():
            raise ParseError(ParseErrorCode.EMPTY, "the document has no text")
        if media_type == "text/html":
            return self._from_html(text, fallback_title)
        if media_type == "text/markdown":
            match = _H1.search(text)
            return ParsedDocument(match.group(1).strip() if match else fallback_title, text)
        if media_type == "text/plain":
            return ParsedDocument(fallback_title, text)
        raise ParseError(ParseErrorCode.UNSUPPORTED, f"cannot parse {media_type}")

    @staticmethod
    def _decode(content: bytes) -> str:
        head = content[:8192]
        # A NUL byte or a run of control characters means a binary file behind a text extension;
        # decoding it would index noise that matches every query.
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
        # Imported lazily: markdownify pulls in BeautifulSoup, which only HTML sources need.
        from markdownify import markdownify

        match = _HTML_TITLE.search(text)
        try:
            markdown = markdownify(_HTML_NOISE.sub("", text), heading_style="ATX")
        except Exception as error:  # markdownify raises whatever the HTML parser raised
            raise ParseError(ParseErrorCode.MALFORMED, f"HTML could not be converted: {error}") from error
        markdown = re.sub(r"\n{3,}", "\n\n", markdown).strip()
        if not markdown:
            raise ParseError(ParseErrorCode.EMPTY, "the HTML page has no text")
        title = re.sub(r"\s+", " ", match.group(1)).strip() if match else ""
        if not title:
            h1 = _H1.search(markdown)
            title = h1.group(1).strip() if h1 else fallback_title
        return ParsedDocument(title, markdown)


def unwrap_lines(text: str) -> str:
    """Join the lines a PDF's layout broke a paragraph into: no space between two CJK characters
    (Chinese takes none, and a stray one would split its keyword bigrams), a space elsewhere.
    Blank lines, the paragraph breaks, stay."""
    return _LINE_BREAK.sub(" ", _CJK_LINE_BREAK.sub("", text))


def _from_pdf(content: bytes, fallback_title: str) -> ParsedDocument:
    """The text layer of every page; a scan without one is empty, not garbage from an OCR guess."""
    # Imported lazily, like markdownify: only PDF sources need pypdf.
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
        raise ParseError(ParseErrorCode.MALFORMED, f"the PDF could not be read: {error}") from error
    paragraphs = [unwrap_lines(page.strip()) for page in pages]
    markdown = re.sub(r"\n{3,}", "\n\n", "\n\n".join(text for text in paragraphs if text))
    if not markdown.strip():
        raise ParseError(ParseErrorCode.EMPTY, "the PDF has no text layer (a scan? run OCR on it first)")
    return ParsedDocument(title or fallback_title, markdown)


def _from_docx(content: bytes, fallback_title: str) -> ParsedDocument:
    """Paragraphs and tables in document order; Word's heading styles become Markdown headings, so
    chunks keep their section path."""
    import docx
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(content))
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
            style = block.style.name if block.style is not None else ""
            level = _HEADING_STYLE.match(style or "")
            if style == "Title":
                blocks.append(f"# {text}")
            elif level:
                blocks.append(f"{'#' * int(level.group(1))} {text}")
            elif (style or "").startswith("List"):
                blocks.append(f"- {text}")
            else:
                blocks.append(text)
        title = (document.core_properties.title or "").strip()
    except Exception as error:  # not a zip, not a Word package, a broken part: python-docx raises each its way
        raise ParseError(ParseErrorCode.MALFORMED, f"the Word document could not be read: {error}") from error
    markdown = "\n\n".join(blocks)
    if not markdown.strip():
        raise ParseError(ParseErrorCode.EMPTY, "the Word document has no text")
    if not title:
        h1 = _H1.search(markdown)
        title = h1.group(1).strip() if h1 else fallback_title
    return ParsedDocument(title, markdown)
