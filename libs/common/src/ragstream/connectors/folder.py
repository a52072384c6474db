"""Local folder connector: Markdown, plain text and HTML files under one root."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

from ragstream.connectors.base import DocumentVanished, SourceItem
from ragstream.parsing import media_type_for

__all__ = ["FolderConnector"]


class FolderConnector:
    """Lists files with their mtime and size as the cheap version, so unchanged files are not read.

    Hidden files and folders are skipped, symlinked folders are not followed (no cycles), and the
    source of each document is its path relative to the root, as citations show it.
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
        self.connection_id = connection_id or "folder-" + hashlib.sha256(str(self.root).encode()).hexdigest()[:16]
        self.name = self.root.name or str(self.root)

    async def list_items(self) -> AsyncIterator[SourceItem]:
        items = await asyncio.to_thread(lambda: list(self._walk(self.root)))
        for item in items:
            yield item

    def _walk(self, folder: Path) -> Iterator[SourceItem]:
        try:
            # A folder sorts as its name + "/", so the walk yields relative paths in ascending string
            # order ("a-b.md" < "a.md" < "a/x.md"), the order a resumed walk's cursor relies on.
            entries = sorted(os.scandir(folder), key=_sort_key)
        except OSError:
            return  # an unreadable or vanished folder lists as empty; its files count as deleted
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(Path(entry.path))
                    continue
                media_type = media_type_for(entry.name)
                if media_type is None or not entry.is_file():
                    continue
                stat = entry.stat()
            except OSError:
                continue
            relative = Path(entry.path).relative_to(self.root).as_posix()
            yield SourceItem(
                external_id=relative,
                title=Path(entry.name).stem,
                source=relative,
                media_type=media_type,
                source_version=f"{stat.st_mtime_ns}:{stat.st_size}",
                size=stat.st_size,
            )

    async def fetch(self, item: SourceItem) -> bytes:
        try:
            return await asyncio.to_thread((self.root / item.external_id).read_bytes)
        except FileNotFoundError as error:
            raise DocumentVanished(item.external_id) from error


def _sort_key(entry: os.DirEntry[str]) -> str:
    try:
        return entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name
    except OSError:
        return entry.name
