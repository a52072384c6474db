"""The vector leg's cost stays O(ef_search), whatever the planner believes about the scope's size."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from ragstream.core.search import SearchFilters
from ragstream.runtime import Runtime
from ragstream.storage.scope import Scope
from ragstream.storage.search import SearchStore
from tests.support.plans import Explaining, rows_read
from tests.test_scope_acl import connection, index

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("nested_loops", ["on", "off"])
async def test_the_scope_is_checked_only_for_the_candidates(runtime: Runtime, nested_loops: str) -> None:
    """The leg reads the chunk rows of its ``ef_search`` candidates, never the whole scope.

    On a freshly ingested corpus (no statistics yet) the planner believed every scope one row long,
    joined the candidates to *all* the scope's chunks by hash, and the leg cost 54 ms at 8,500
    chunks, growing with the corpus (docs/vector-leg.md). ``enable_nestloop = off`` makes it prefer
    that plan here too, whatever the statistics of the shared test database say."""
    rng = np.random.default_rng(11)
    dimension, documents, per_document, ef_search = 16, 40, 10, 40
    model_key = f"test-plan-{uuid.uuid4().hex[:8]}"
    scope_id = await connection(runtime)
    vectors = rng.normal(size=(documents * per_document, dimension)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for number in range(documents):
        rows = slice(number * per_document, (number + 1) * per_document)
        texts = [f"chunk {i} of p{number}" for i in range(per_document)]
        await index(runtime, scope_id, f"p{number}.md", texts, vectors=vectors[rows], model_key=model_key)
    table = await SearchStore(runtime.pool).embedding_table(model_key)
    assert table is not None
    scope = Scope.build(SearchFilters(connection_ids=[scope_id]), None, first_param=3)
    async with runtime.pool.acquire() as raw, raw.transaction():
        await raw.execute(f"SET LOCAL enable_nestloop = {nested_loops}")
        explaining = Explaining(raw)
        hits, visible, seen = await SearchStore._hnsw_scan(  # the statement under test
            explaining,  # type: ignore[arg-type]
            table,
            "e.embedding",
            vectors[0],
            30,
            scope,
            ef_search,
        )
    assert seen == visible == ef_search and len(hits) == 30
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)  # the query is the first chunk's own vector
    # 400 chunks in scope, 40 candidates: only the candidates' chunk rows are read.
    assert rows_read(explaining.plan, "chunks") <= ef_search
    assert rows_read(explaining.plan, "documents") <= ef_search
