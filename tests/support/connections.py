"""Helpers for connection tests: a folder synced under an API-made id, and a private database."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from ragstream.connectors.base import SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream.storage.database import connect_pool

__all__ = ["BoundFolder", "fetcher_database", "private_database"]


class BoundFolder:
    """A folder's documents under a given connection id, as a sync run of that connection lists them."""

    platform = "folder"

    def __init__(self, connection_id: str, root: Path) -> None:
        self.connection_id = connection_id
        self._folder = FolderConnector(root)
        self.name = self._folder.name

    def list_items(self) -> AsyncIterator[SourceItem]:
        return self._folder.list_items()

    async def fetch(self, item: SourceItem) -> bytes:
        return await self._folder.fetch(item)


@asynccontextmanager
async def private_database(database_url: str) -> AsyncIterator[str]:
    """A new, empty database on the test server, dropped afterwards: for what acts on every connection
    (credential rotation), which must not meet the other tests' rows in the shared database."""
    name = f"ragstream_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        try:
            yield urlunsplit(urlsplit(database_url)._replace(path=f"/{name}"))
        finally:
            await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    finally:
        await admin.close()


@asynccontextmanager
async def fetcher_database(
    database_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch, **settings: str
) -> AsyncIterator[asyncpg.Pool]:
    """A private database, and the environment an in-process connector-fetcher reads its settings
    from pointed at it (``settings`` as ``RAGSTREAM_<NAME>``); yields a pool on that database."""
    async with private_database(database_url) as dsn:
        monkeypatch.setenv("DATABASE_URL", dsn)
        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
        monkeypatch.delenv("RAGSTREAM_API_KEYS", raising=False)
        monkeypatch.setenv("RAGSTREAM_AUTH", "none")  # the fetcher refuses to start without keys otherwise
        for name, value in settings.items():
            monkeypatch.setenv(f"RAGSTREAM_{name.upper()}", value)
        pool = await connect_pool(dsn)
        try:
            yield pool
        finally:
            await pool.close()
