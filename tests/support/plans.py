"""Plans of the statements a store runs, to pin what a query reads whatever the planner believes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import asyncpg

__all__ = ["Explaining", "nodes", "rows_examined", "rows_read", "subplan"]


class Explaining:
    """Passes statements through to a connection, and keeps the plans (EXPLAIN ANALYZE) of the
    statements it fetched, in order."""

    def __init__(self, connection: asyncpg.Connection) -> None:
        self._connection = connection
        self.plans: list[dict[str, Any]] = []

    @property
    def plan(self) -> dict[str, Any]:
        """The plan of the last statement fetched."""
        return self.plans[-1]

    async def execute(self, sql: str, *args: Any) -> str:
        return str(await self._connection.execute(sql, *args))

    async def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        await self._explain(sql, *args)
        return await self._connection.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        await self._explain(sql, *args)
        return await self._connection.fetchval(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        await self._explain(sql, *args)
        return list(await self._connection.fetch(sql, *args))

    async def _explain(self, sql: str, *args: Any) -> None:
        explained = await self._connection.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
        self.plans.append(json.loads(explained)[0]["Plan"])


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The plan's nodes, the plan first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def rows_read(plan: dict[str, Any], relation: str) -> int:
    """Rows the plan's scans of ``relation`` produced, over all their loops."""
    return sum(int(node["Actual Rows"] * node["Actual Loops"]) for node in _scans(plan, relation))


def rows_examined(plan: dict[str, Any], relation: str) -> int:
    """Rows the plan's scans of ``relation`` read, those their filters removed included, over all
    their loops."""
    return sum(
        int(
            (node["Actual Rows"] + node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0))
            * node["Actual Loops"]
        )
        for node in _scans(plan, relation)
    )


def _scans(plan: dict[str, Any], relation: str) -> Iterator[dict[str, Any]]:
    return (node for node in nodes(plan) if node.get("Relation Name") == relation)


def subplan(plan: dict[str, Any], name: str) -> dict[str, Any]:
    """The part of the plan that computes ``name`` (``"CTE matched"``, ``"InitPlan 1"``)."""
    if plan.get("Subplan Name") == name:
        return plan
    for child in plan.get("Plans", []):
        with contextlib.suppress(LookupError):
            return subplan(child, name)
    raise LookupError(f"no {name} in the plan")
