"""Identifiers interpolated into SQL: every table name a statement is built with goes through
:func:`identifier`, never straight into the text."""

from __future__ import annotations

__all__ = ["MAX_IDENTIFIER_BYTES", "identifier"]

MAX_IDENTIFIER_BYTES = 63
"""PostgreSQL's ``NAMEDATALEN - 1``: a longer name would be cut silently and name another table."""


def identifier(name: str) -> str:
    """``name`` as a double-quoted PostgreSQL identifier, its own double quotes doubled (what
    PostgreSQL's ``quote_ident`` and asyncpg's ``_quote_ident`` do, but always quoted).

    Quoted, a name is taken verbatim (no case folding, no keyword), so a space table called
    ``embeddings_x`` is the same table as before. ``ValueError`` for an empty name, one with a NUL
    (PostgreSQL cannot store it) or one longer than :data:`MAX_IDENTIFIER_BYTES` in UTF-8.
    """
    if not name:
        raise ValueError("an SQL identifier cannot be empty")
    if "\x00" in name:
        raise ValueError("an SQL identifier cannot contain a NUL character")
    if len(name.encode()) > MAX_IDENTIFIER_BYTES:
        raise ValueError(f"SQL identifier {name[:20]!r}... is longer than {MAX_IDENTIFIER_BYTES} bytes")
    return '"' + name.replace('"', '""') + '"'
