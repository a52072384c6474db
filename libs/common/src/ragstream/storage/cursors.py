"""Per-connection, per-stage sync cursors: where each stage's walk got to, and in which direction.

A walk begins when a stage starts a sync and completes when the stage has handled everything. A walk
that never completed (the process was killed, the run failed) is resumed by the next sync of that
connection instead of started over. The first completed walk of a stage is its backward (full,
historical) walk; every later one is forward (incremental).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import asyncpg

__all__ = ["Direction", "Stage", "SyncCursor", "SyncCursorStore"]

Stage = Literal["download", "index"]
Direction = Literal["backward", "forward"]


@dataclass(frozen=True, slots=True)
class SyncCursor:
    """One stage's walk. ``resumed``: it was begun by an earlier sync that did not complete it."""

    connection_id: str
    stage: Stage
    direction: Direction
    position: str | None
    items: int
    completed: bool
    resumed: bool = False

    @classmethod
    def from_row(cls, row: asyncpg.Record, *, resumed: bool = False) -> SyncCursor:
        return cls(
            connection_id=row["connection_id"],
            stage=row["stage"],
            direction=row["direction"],
            position=row["position"],
            items=row["items"],
            completed=row["completed_at"] is not None,
            resumed=resumed,
        )


class SyncCursorStore:
    """Every read and write of ``sync_cursors``. One sync per connection runs at a time (``runs``),
    so a cursor has one writer; the row lock in ``begin`` only guards against a stray second one."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def begin(self, connection_id: str, stage: Stage) -> SyncCursor:
        """Resume the stage's unfinished walk, or begin a new one: backward if the stage never
        completed a walk of this connection, forward otherwise."""
        async with self._pool.acquire() as connection, connection.transaction():
            row = await connection.fetchrow(
                "SELECT * FROM sync_cursors WHERE connection_id = $1 AND stage = $2 FOR UPDATE", connection_id, stage
            )
            if row is not None and row["completed_at"] is None:
                return SyncCursor.from_row(row, resumed=True)
            row = await connection.fetchrow(
                "INSERT INTO sync_cursors (connection_id, stage, direction) VALUES ($1, $2, $3)"
                " ON CONFLICT (connection_id, stage) DO UPDATE SET direction = EXCLUDED.direction, position = NULL,"
                " items = 0, started_at = now(), completed_at = NULL, updated_at = now() RETURNING *",
                connection_id,
                stage,
                "forward" if row is not None else "backward",
            )
        assert row is not None
        return SyncCursor.from_row(row)

    async def advance(self, connection_id: str, stage: Stage, position: str, items: int) -> None:
        """Record that the walk has finished everything up to ``position`` (``items`` in all)."""
        await self._pool.execute(
            "UPDATE sync_cursors SET position = $3, items = $4, updated_at = now()"
            " WHERE connection_id = $1 AND stage = $2 AND completed_at IS NULL",
            connection_id,
            stage,
            position,
            items,
        )

    async def complete(self, connection_id: str, stage: Stage, items: int) -> None:
        """The walk handled everything: the next sync of this stage begins a forward walk."""
        await self._pool.execute(
            "UPDATE sync_cursors SET items = $3, completed_at = now(), updated_at = now()"
            " WHERE connection_id = $1 AND stage = $2 AND completed_at IS NULL",
            connection_id,
            stage,
            items,
        )

    async def get(self, connection_id: str, stage: Stage) -> SyncCursor | None:
        row = await self._pool.fetchrow(
            "SELECT * FROM sync_cursors WHERE connection_id = $1 AND stage = $2", connection_id, stage
        )
        return SyncCursor.from_row(row) if row is not None else None
