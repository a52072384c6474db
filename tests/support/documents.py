"""Real PDF and Word files built in memory, for the parsers and the pipeline to read."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterable
from pathlib import Path

import docx.document

__all__ = ["docx_bytes", "pdf_with_text", "streamed_docx"]


def pdf_with_text(*pages: str, title: str | None = None) -> bytes:
    """A real PDF whose pages each draw one text line per line of ``pages`` (Helvetica, Latin-1)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", ""]
    kids = []
    for page in pages:
        lines = "".join(f"({line}) Tj 0 -16 Td " for line in page.split("\n"))
        stream = f"BT /F1 12 Tf 72 720 Td {lines}ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {len(objects)} 0 R"
            " /Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>"
        )
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    info = ""
    if title is not None:
        objects.append(f"<< /Title ({title}) >>")
        info = f" /Info {len(objects)} 0 R"
    out, offsets = io.BytesIO(), []
    out.write(b"%PDF-1.4\n")
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1"))
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    out.write("".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode())
    out.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R{info} >>\nstartxref\n{xref}\n%%EOF\n".encode())
    return out.getvalue()


def docx_bytes(document: docx.document.Document) -> bytes:
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


_CONTENT_TYPES = (
    '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
    '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
    '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
    '<Default Extension="xml" ContentType="application/xml"/>'
    '<Override PartName="/word/document.xml" '
    'ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
    "</Types>"
)
_RELS = (
    '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
    '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
    '<Relationship Id="rId1" Target="word/document.xml" '
    'Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument"/>'
    "</Relationships>"
)
_BODY_OPEN = (
    '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
    '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>'
)


def streamed_docx(path: Path, paragraphs: Iterable[str], padding: Iterable[bytes] = ()) -> None:
    """A minimal Word package written member by member, so a huge one never sits in memory: one
    paragraph per item of ``paragraphs``, and a ``word/padding.bin`` member of the ``padding`` chunks."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as package:
        package.writestr("[Content_Types].xml", _CONTENT_TYPES)
        package.writestr("_rels/.rels", _RELS)
        with package.open("word/document.xml", "w", force_zip64=True) as body:
            body.write(_BODY_OPEN.encode())
            for text in paragraphs:
                body.write(f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>".encode())
            body.write(b"</w:body></w:document>")
        with package.open("word/padding.bin", "w", force_zip64=True) as member:
            for chunk in padding:
                member.write(chunk)
