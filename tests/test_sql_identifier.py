"""Table names interpolated into SQL are quoted by one helper, and PostgreSQL reads them back verbatim."""

from __future__ import annotations

import asyncpg
import pytest

from ragstream.runtime import Runtime
from ragstream.storage.sql import MAX_IDENTIFIER_BYTES, identifier


@pytest.mark.parametrize(
    ("name", "quoted"),
    [
        ("embeddings_bge_small_1a2b3c", '"embeddings_bge_small_1a2b3c"'),
        ("Mixed Case", '"Mixed Case"'),
        ('say "hi"', '"say ""hi"""'),
        ("chunks; DROP TABLE chunks", '"chunks; DROP TABLE chunks"'),
        ("向量", '"向量"'),
        ("x" * MAX_IDENTIFIER_BYTES, '"' + "x" * MAX_IDENTIFIER_BYTES + '"'),
    ],
)
def test_a_name_is_double_quoted_with_its_quotes_doubled(name: str, quoted: str) -> None:
    assert identifier(name) == quoted


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "empty"),
        ("bad\x00name", "NUL"),
        ("x" * (MAX_IDENTIFIER_BYTES + 1), "longer than"),
        ("向" * 22, "longer than"),  # 66 bytes in UTF-8, 22 characters
    ],
)
def test_a_name_postgresql_would_refuse_or_cut_is_refused(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        identifier(name)


async def test_postgresql_reads_a_quoted_name_back_verbatim(runtime: Runtime) -> None:
    awkward = 'Ragstream "odd" table; --'
    async with runtime.pool.acquire() as connection, connection.transaction():
        await connection.execute(f"CREATE TEMP TABLE {identifier(awkward)} (id int) ON COMMIT DROP")
        await connection.execute(f"INSERT INTO {identifier(awkward)} VALUES (7)")
        assert await connection.fetchval(f"SELECT id FROM {identifier(awkward)}") == 7
        assert await connection.fetchval("SELECT relname FROM pg_class WHERE relname = $1", awkward) == awkward
        with pytest.raises(asyncpg.UndefinedTableError):  # folded, the name would be another table's
            async with connection.transaction():  # a savepoint: the outer transaction goes on
                await connection.execute(f"SELECT id FROM {identifier(awkward.lower())}")
