"""Real PDF and Word files built in memory, for the parsers and the pipeline to read."""

from __future__ import annotations

import io

import docx.document

__all__ = ["docx_bytes", "pdf_with_text"]


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
