"""Raw bytes to Markdown text: the one place that decides whether a document is readable at all."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["ParseError", "ParseErrorCode", "ParsedDocument", "Parser", "media_type_for"]

_MEDIA_TYPES = {
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".txt": "text/plain",
    ".text": "text/plain",
    ".html": "text/html",
    ".htm": "text/html",
}
_CONTROL = re.compile(rb"[\x00-\x08\x0e-\x1f]")
_H1 = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.MULTILINE)
_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_HTML_NOISE = re.compile(r"<(script|style|head|nav|noscript)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)


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
    """Decodes and normalises md, txt and html; rejects what would index as garbage."""

    def __init__(self, max_bytes: int = 16 * 1024 * 1024) -> None:
        self._max_bytes = max_bytes

    def run(self, content: bytes, media_type: str, fallback_title: str) -> ParsedDocument:
        if len(content) > self._max_bytes:
            raise ParseError(ParseErrorCode.TOO_LARGE, f"{len(content)} bytes is over the limit of {self._max_bytes}")
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
