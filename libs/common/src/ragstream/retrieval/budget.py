"""Context budget: about 3,000 characters per result and 12,000 per call, cut at sentence ends."""

from __future__ import annotations

import re

__all__ = ["MAX_CALL_CHARS", "MAX_RESULT_CHARS", "preview", "truncate_text"]

MAX_RESULT_CHARS = 3000
MAX_CALL_CHARS = 12000
_SENTENCE_END = re.compile(r"(?<=[.!?。！？；;])\s*|\n+")


def truncate_text(text: str, limit: int) -> str:
    """Cut at the last sentence end within ``limit`` so a result never ends mid-sentence when avoidable."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    ends = [match.end() for match in _SENTENCE_END.finditer(cut) if match.end() > limit // 2]
    return (cut[: ends[-1]] if ends else cut).rstrip() + " …"


def preview(text: str, terms: list[str], limit: int = 240) -> str:
    """The paragraph that mentions a query term first (else the first one), for a source card."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and not p.lstrip().startswith("#")]
    if not paragraphs:
        paragraphs = [text.strip()]
    lowered = [p.lower() for p in paragraphs]
    chosen = next(
        (p for p, low in zip(paragraphs, lowered, strict=True) if any(t in low for t in terms)), paragraphs[0]
    )
    return truncate_text(" ".join(chosen.split()), limit)
