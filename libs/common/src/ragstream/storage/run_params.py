"""The params of runs that a job's own storage writes and reads in its transactions: a re-index
names its target where it prepares it, a re-chunk finds the index version an earlier run left.

Apart from ``storage.runs`` (which reads connections for the sync kind) so that the storage modules
of the jobs can use it without importing the connectors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

import asyncpg

__all__ = ["RunKind", "json_object", "latest_params", "record_params"]

RunKind = Literal["sync", "reindex", "rechunk", "replay"]


def json_object(value: Any) -> dict[str, Any]:
    """A jsonb column's object (asyncpg hands jsonb over as text), ``{}`` for NULL."""
    loaded = json.loads(value) if isinstance(value, str) else value
    return dict(loaded or {})


async def record_params(connection: asyncpg.Connection, run_id: int, params: Mapping[str, Any]) -> None:
    """Merge ``params`` into a run's, in the caller's transaction (a re-index names its target in the
    same transaction that prepares it)."""
    await connection.execute("UPDATE runs SET params = params || $2::jsonb WHERE id = $1", run_id, json.dumps(params))


async def latest_params(connection: asyncpg.Connection, kind: RunKind, connection_id: str, key: str) -> list[Any]:
    """The params of the connection's runs of ``kind`` that have ``key``, newest first."""
    rows = await connection.fetch(
        "SELECT params FROM runs WHERE kind = $1 AND connection_id = $2 AND params ? $3 ORDER BY id DESC",
        kind,
        connection_id,
        key,
    )
    return [json_object(row["params"]) for row in rows]
