"""Text PostgreSQL can store: no NUL character and no lone surrogate (neither has a UTF-8 form it accepts)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

__all__ = ["Storable", "StorableStr", "check_storable", "strip_unstorable"]

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def strip_unstorable(text: str) -> str:
    """``text`` without its NUL characters and lone surrogates (a paired surrogate never reaches a
    Python ``str``, so every surrogate in one is lone)."""
    return _UNSTORABLE.sub("", text)


def check_storable(text: str | None) -> str | None:
    """``text`` unchanged (``None`` too), or ``ValueError`` naming what PostgreSQL would refuse; as a
    pydantic validator that becomes a 422 over HTTP and INVALID_ARGUMENT over gRPC, not a database error."""
    found = _UNSTORABLE.search(text) if text is not None else None
    if found is not None:
        what = "a NUL character" if found.group() == "\x00" else "a lone surrogate"
        raise ValueError(f"contains {what} at position {found.start()}, which cannot be stored or searched")
    return text


Storable = AfterValidator(check_storable)
"""The check as ``Annotated`` metadata, placed after a ``Field`` with length limits so that those keep
their own messages: ``Annotated[str | None, Field(max_length=200), Storable]``."""

StorableStr = Annotated[str, Storable]
"""A request string that may reach SQL."""
