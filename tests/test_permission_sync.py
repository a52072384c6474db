"""A permission-only change at the source reaches the chunks' ACLs without re-reading or re-embedding."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from ragstream.connectors.base import SourceItem
from ragstream.connectors.folder import FolderConnector
from ragstream.retrieval import Principal, SearchFilters, SearchRequest
from ragstream.runtime import Runtime

pytestmark = pytest.mark.integration


class SharedFolder(FolderConnector):
    """A folder whose files carry the ACLs of a sharing table, as a wiki's pages carry their members."""

    def __init__(self, root: Path, shared_with: dict[str, tuple[str, ...]]) -> None:
        super().__init__(root)
        self.shared_with = shared_with
        self.fetched: list[str] = []

    async def list_items(self) -> AsyncIterator[SourceItem]:
        async for item in super().list_items():
            yield replace(item, acl=self.shared_with.get(item.external_id), knowledge_base="Handbook")

    async def fetch(self, item: SourceItem) -> bytes:
        self.fetched.append(item.external_id)
        return await super().fetch(item)


async def visible_sources(runtime: Runtime, connection: str, user: str) -> set[str]:
    response = await runtime.retriever.search(
        SearchRequest(
            query="salary bands review",
            filters=SearchFilters(connection_ids=[connection]),
            principal=Principal(user=user),
        )
    )
    return {result.source for result in response.results}


async def test_permission_change_rewrites_acls_without_reembedding(runtime: Runtime, tmp_path: Path) -> None:
    (tmp_path / "salaries.md").write_text("# Salaries\n\nThe salary bands are reviewed every spring.\n")
    (tmp_path / "holidays.md").write_text("# Holidays\n\nThe salary bands do not change the holidays.\n")
    connector = SharedFolder(tmp_path, {"salaries.md": ("user:alice",)})
    first = await runtime.pipeline().sync(connector)
    assert first.ok and first.progress.indexed == 2
    connection = connector.connection_id
    assert await visible_sources(runtime, connection, "alice") == {"salaries.md", "holidays.md"}
    assert await visible_sources(runtime, connection, "bob") == {"holidays.md"}
    vectors_before = await runtime.pool.fetch(
        "SELECT c.id, d.version, d.knowledge_base FROM chunks c JOIN documents d ON d.id = c.document_id"
        " WHERE d.connection_id = $1 ORDER BY c.id",
        connection,
    )
    assert {row["knowledge_base"] for row in vectors_before} == {"Handbook"}

    # Shared with bob instead of alice, and holidays restricted to a group: nothing else changed.
    connector.shared_with = {"salaries.md": ("user:bob",), "holidays.md": ("group:staff", "user:bob")}
    connector.fetched.clear()
    second = await runtime.pipeline().sync(connector)
    assert (second.progress.unchanged, second.progress.indexed, connector.fetched) == (2, 0, [])
    assert await visible_sources(runtime, connection, "alice") == set()
    assert await visible_sources(runtime, connection, "bob") == {"salaries.md", "holidays.md"}
    # Same chunks, same versions: nothing was chunked or embedded again.
    assert (
        await runtime.pool.fetch(
            "SELECT c.id, d.version, d.knowledge_base FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.connection_id = $1 ORDER BY c.id",
            connection,
        )
        == vectors_before
    )

    # Opened to everyone again.
    connector.shared_with = {}
    await runtime.pipeline().sync(connector)
    assert await visible_sources(runtime, connection, "alice") == {"salaries.md", "holidays.md"}
