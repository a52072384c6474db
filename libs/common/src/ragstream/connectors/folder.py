"""Local folder connector: Markdown, plain text and HTML files under one root, and nothing outside it.

Symlinks are never followed (files or folders), so a link cannot pull ``/etc/passwd`` into the index;
FIFOs, sockets and devices are never opened. Each entry left out for such a reason is logged and
counted in ``skipped`` by reason (``symlink``, ``special_file``, ``unreadable``), which the sync reports.
A file is opened component by component with ``O_NOFOLLOW`` and read only if ``fstat`` says it is a
regular file, so an entry swapped for a link between the listing and the read is refused too.

A folder given over the API must lie inside one of ``RAGSTREAM_FOLDER_ROOTS`` (``confined_folder``).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import stat
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ragstream.connectors.base import DocumentUnreadable, DocumentVanished, SourceItem
from ragstream.core.errors import InvalidInput
from ragstream.parsing import media_type_for

__all__ = ["FolderConnector", "FolderNotAllowed", "confined_folder", "folder_connection_id"]

logger = logging.getLogger(__name__)

# Bytes kept as they are when a name that is not UTF-8 is percent-encoded: printable ASCII but "%".
_PLAIN = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")


class FolderNotAllowed(InvalidInput, ValueError):
    """A folder path outside every allowed root, relative, or not a directory; the message says which."""


def confined_folder(path: str | Path, roots: Sequence[Path]) -> Path:
    """``path`` resolved (symlinks and ``..``), if it is an absolute path to a directory inside one of
    ``roots``; ``FolderNotAllowed`` otherwise."""
    given = Path(path)
    if not given.is_absolute():
        raise FolderNotAllowed(f"folder path {str(path)!r} is relative: give an absolute path")
    if not roots:
        raise FolderNotAllowed(
            "folder connections over the API need RAGSTREAM_FOLDER_ROOTS, the folders they may read; none is set"
        )
    resolved = given.resolve()
    if not resolved.is_dir():
        raise FolderNotAllowed(f"folder path {str(path)!r} is not an existing directory")
    for root in roots:
        if resolved.is_relative_to(root.resolve()):
            return resolved
    raise FolderNotAllowed(f"folder path {str(path)!r} is outside RAGSTREAM_FOLDER_ROOTS")


def folder_connection_id(folder: Path) -> str:
    """The id of the connection that ``ragstream ingest`` / ``up --source`` registers for ``folder``."""
    return "folder-" + hashlib.sha256(str(folder.resolve()).encode(errors="surrogateescape")).hexdigest()[:16]


class FolderConnector:
    """Lists files with their mtime and size as the cheap version, so unchanged files are not read.

    Hidden files and folders, and files of other types, are left out without a report. The source of
    each document is its path relative to the root, as citations show it; a name that is not UTF-8
    has its bytes percent-encoded there (``bad%FFname.md``), and ``%`` with them, so it still indexes.
    """

    platform = "folder"

    def __init__(
        self, root: Path, config: Mapping[str, Any] | None = None, *, connection_id: str | None = None
    ) -> None:
        """``connection_id`` is the stored connection's id; by default one derived from the path, so
        syncing the same folder from the CLI always lands in the same connection."""
        self.root = root.resolve()
        # The connection's config to store (e.g. ``{"chunking": {...}}``); None keeps the stored one.
        self.config = dict(config) if config is not None else None
        if not self.root.is_dir():
            raise NotADirectoryError(f"{root} is not a folder")
        self.connection_id = connection_id or folder_connection_id(self.root)
        self.name = self.root.name or str(self.root)
        self.skipped: Counter[str] = Counter()
        # The on-disk relative path of each listed id that had to be encoded.
        self._encoded: dict[str, str] = {}

    async def list_items(self) -> AsyncIterator[SourceItem]:
        self.skipped.clear()
        self._encoded.clear()
        items = await asyncio.to_thread(lambda: list(self._walk(self.root, "")))
        for item in items:
            yield item

    def _skip(self, relative: str, reason: str) -> None:
        self.skipped[reason] += 1
        logger.warning("folder %s: %s skipped (%s)", self.root, _portable(relative), reason)

    def _walk(self, folder: Path, prefix: str) -> Iterator[SourceItem]:
        try:
            # A folder sorts as its name + "/", so the walk yields ids in ascending string order
            # ("a-b.md" < "a.md" < "a/x.md"), the order a resumed walk's cursor relies on.
            entries = sorted(os.scandir(folder), key=_sort_key)
        except OSError:
            # Its files count as deleted, and the report says why.
            self._skip(prefix.rstrip("/") or ".", "unreadable")
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            relative = prefix + entry.name
            try:
                if entry.is_symlink():
                    self._skip(relative, "symlink")
                    continue
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(Path(entry.path), relative + "/")
                    continue
                if not entry.is_file(follow_symlinks=False):
                    self._skip(relative, "special_file")
                    continue
                media_type = media_type_for(entry.name)
                if media_type is None:
                    continue
                status = entry.stat(follow_symlinks=False)
            except OSError:
                self._skip(relative, "unreadable")
                continue
            external_id = _portable(relative)
            if external_id != relative:
                self._encoded[external_id] = relative
            yield SourceItem(
                external_id=external_id,
                title=Path(_portable(entry.name)).stem,
                source=external_id,
                media_type=media_type,
                source_version=f"{status.st_mtime_ns}:{status.st_size}",
                size=status.st_size,
            )

    async def fetch(self, item: SourceItem) -> bytes:
        relative = self._encoded.get(item.external_id, item.external_id)
        return await asyncio.to_thread(self._read, relative, item)

    def _read(self, relative: str, item: SourceItem) -> bytes:
        """Open each component below the root with O_NOFOLLOW, so no link is followed on the way, and
        read no more than the listed size (which the fetch stage held against the size limit)."""
        parts = relative.split("/")
        try:
            folder = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for part in parts[:-1]:
                    inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
                    os.close(folder)
                    folder = inner
                # O_NONBLOCK: a FIFO swapped in does not block the open; it is refused below.
                handle = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
            finally:
                os.close(folder)
        except FileNotFoundError as error:
            raise DocumentVanished(item.external_id) from error
        except OSError as error:
            # O_NOFOLLOW met a link (ELOOP; ENOTDIR for a folder's) swapped in since the listing.
            if error.errno in (errno.ELOOP, errno.ENOTDIR) and self._has_link(parts):
                raise DocumentUnreadable(
                    "symlink", "a link since it was listed: not followed", retryable=False
                ) from None
            raise  # the fetch stage records it unreadable
        with os.fdopen(handle, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise DocumentUnreadable("special_file", "not a regular file", retryable=False)
            limit = item.size or 0
            content = file.read(limit + 1)
        if len(content) > limit:
            raise DocumentUnreadable(
                "changed_while_reading", "the file grew after it was listed; the next sync reads it", retryable=True
            )
        return content

    def _has_link(self, parts: list[str]) -> bool:
        return any(os.path.islink(self.root.joinpath(*parts[:depth])) for depth in range(1, len(parts) + 1))


def _portable(relative: str) -> str:
    """``relative`` as it is if it is UTF-8; else its bytes percent-encoded (``%`` too), which keeps
    every name distinct and storable."""
    try:
        relative.encode()
    except UnicodeEncodeError:
        return quote(os.fsencode(relative), safe=_PLAIN)
    return relative


def _sort_key(entry: os.DirEntry[str]) -> str:
    try:
        name = _portable(entry.name)
        return name + "/" if entry.is_dir(follow_symlinks=False) else name
    except OSError:
        return entry.name
