"""The WHERE clause every retrieval leg shares: scope filters and permissions, applied inside SQL.

Filtering inside each leg, not after fusion, is what makes a forbidden chunk impossible to return,
count or hint at: it never enters a ranking.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ragstream.core.search import Principal, SearchFilters

__all__ = ["Scope"]


@dataclass(frozen=True, slots=True)
class Scope:
    """SQL over the aliases ``c`` (chunks), ``d`` (documents) and ``k`` (connections)."""

    sql: str
    params: list[Any] = field(default_factory=list)
    first_param: int = 1
    # A filter on document columns (knowledge bases, sources, metadata): the keyword leg then cannot
    # read in-scope term frequencies per connection and scores the scope exactly.
    document_filters: bool = False

    @classmethod
    def build(cls, filters: SearchFilters, principal: Principal | None, *, first_param: int) -> Scope:
        """``first_param`` is the number of the first ``$n`` placeholder this clause may use."""
        # rag_enabled: a document of a switched-off connection still in flight never shows.
        # index_version: only the connection's active index; a re-chunk builds the next one beside it.
        clauses = ["d.status = 'indexed'", "k.status = 'active'", "k.rag_enabled", "c.index_version = k.index_version"]
        params: list[Any] = []

        def param(value: Any) -> str:
            params.append(value)
            return f"${first_param + len(params) - 1}"

        principals = principal.principals() if principal else []
        clauses.append(f"(k.skip_acl OR c.acl IS NULL OR c.acl && {param(principals)}::text[])")
        for column, values in (
            ("d.connection_id", filters.connection_ids),
            ("k.platform", filters.platforms),
            ("d.knowledge_base", filters.knowledge_bases),
            ("d.source", filters.sources),
        ):
            if values is not None:
                clauses.append(f"{column} = ANY({param(values)}::text[])")
        if filters.metadata:
            clauses.append(f"d.metadata @> {param(json.dumps(filters.metadata))}::jsonb")
        document_filters = any(values is not None for values in (filters.knowledge_bases, filters.sources)) or bool(
            filters.metadata
        )
        return cls(" AND ".join(clauses), params, first_param, document_filters)

    def restricted(self, clause: str, value: Any) -> Scope:
        """This scope and ``clause``, whose ``{param}`` becomes the placeholder of ``value``."""
        placeholder = f"${self.first_param + len(self.params)}"
        return Scope(
            f"{self.sql} AND {clause.format(param=placeholder)}",
            [*self.params, value],
            self.first_param,
            self.document_filters or "d." in clause or "c." in clause,
        )

    @property
    def joins(self) -> str:
        return "JOIN documents d ON d.id = c.document_id JOIN connections k ON k.id = d.connection_id"

    @property
    def joins_by_chunk(self) -> str:
        """``joins`` for chunks picked by key: each chunk's document looked up by its id. From a few
        thousand chunks on, the planner would rather hash every document (a scan of all of them,
        63 ms at 195k documents); ``OFFSET 0`` keeps the lookup a subquery it cannot turn into that."""
        return (
            "CROSS JOIN LATERAL (SELECT * FROM documents WHERE documents.id = c.document_id OFFSET 0) AS d"
            " JOIN connections k ON k.id = d.connection_id"
        )
