"""The vector leg's cost on a freshly ingested corpus: the scope joined to the HNSW candidates, before
and after the per-candidate probe (docs/vector-leg.md, "What the vector leg cost").

Writes ``--chunks`` chunks the way the indexer does (``DocumentStore.commit_document``, one
transaction per document of 10 chunks, synthetic 512-d vectors shaped like text embeddings, no
``ANALYZE``), then over ``--queries`` queries in one read-only snapshot at ef_search 100:

* *join (before)*: the statement as it was, candidates joined to chunks, documents, connections;
* *probe (now)*: ``SearchStore._hnsw_scan``'s statement, each candidate checked by primary key;
* *bare*: ``ORDER BY embedding <=> $1 LIMIT 30`` alone, no scope;

and prints p50/p95 per statement, the median buffers and chunk rows of ``EXPLAIN (ANALYZE,
BUFFERS)``, then ``SearchStore.vector_leg`` in its snapshot, with the load average.

    .venv/bin/python bench/vector_leg_cost.py            # a private server in --data-dir
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from bench.vector_recall import synthesize
from ragstream.core.search import SearchFilters
from ragstream.messages import ChunkPayload, DocumentHeader
from ragstream.storage.database import apply_migrations, connect_pool
from ragstream.storage.documents import DocumentStore
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.scope import Scope
from ragstream.storage.search import SearchStore, _scope_probe

__all__ = ["main"]

MODEL = "bench-cost-512"
EF = 100
LIMIT = 30


def statement(table: str, scope: Scope, visible: str) -> str:
    return (
        f"WITH candidates AS MATERIALIZED (SELECT e.chunk_id, e.embedding <=> $1 AS distance FROM {table} e"
        f"  ORDER BY e.embedding <=> $1 LIMIT {EF}), visible AS ({visible})"
        " SELECT (SELECT count(*) FROM candidates) AS seen, (SELECT count(*) FROM visible) AS visible,"
        " ARRAY(SELECT ROW(id, 1 - distance) FROM visible ORDER BY distance, id LIMIT $2) AS hits"
    )


def statements(table: str, scope: Scope) -> dict[str, str]:
    joined = (
        f"SELECT c.id, ca.distance FROM candidates ca JOIN chunks c ON c.id = ca.chunk_id {scope.joins}"
        f" WHERE {scope.sql}"
    )
    probed = f"SELECT v.id, ca.distance FROM candidates ca CROSS JOIN LATERAL ({_scope_probe(scope)}) AS v"
    return {
        "join (before)": statement(table, scope, joined),
        "probe (now)": statement(table, scope, probed),
        "bare": f"SELECT chunk_id, $2::int FROM {table} ORDER BY embedding <=> $1 LIMIT {LIMIT}",
    }


async def ingest(pool: asyncpg.Pool, chunks: int, seed: int) -> np.ndarray:
    """The corpus, committed document by document unless already there; returns the queries."""
    corpus = synthesize(chunks, 512, 50, seed, 1.2)
    store = DocumentStore(pool)
    if await pool.fetchval("SELECT count(*) FROM documents WHERE connection_id = 'bench-cost'"):
        return corpus.queries
    rng = np.random.default_rng(seed)
    words = [f"w{number:x}" for number in range(20_000)]
    await store.ensure_connection("bench-cost", "folder", "bench-cost")
    started = time.perf_counter()
    for number in range(chunks // 10):
        header = DocumentHeader(
            document_id=f"bench-cost-{number}",
            connection_id="bench-cost",
            external_id=f"d{number}.md",
            version=await store.next_version(),
            content_hash=str(number),
            title=f"Document {number}",
            source=f"d{number}.md",
            media_type="text/markdown",
        )
        texts = [" ".join(rng.choice(words, 170)) for _ in range(10)]
        payloads = [ChunkPayload(ordinal=index, heading=f"Part {index}", text=text) for index, text in enumerate(texts)]
        await store.commit_document(header, payloads, corpus.vectors[number * 10 : (number + 1) * 10], MODEL)
    print(f"ingested {chunks} chunks in {time.perf_counter() - started:.0f} s")
    return corpus.queries


def rows_read(plan: dict[str, Any], relation: str) -> int:
    own = plan["Actual Rows"] * plan["Actual Loops"] if plan.get("Relation Name") == relation else 0
    return int(own) + sum(rows_read(child, relation) for child in plan.get("Plans", []))


async def bench(dsn: str, args: argparse.Namespace) -> None:
    await apply_migrations(dsn)
    pool = await connect_pool(dsn, max_size=2)
    try:
        queries = await ingest(pool, args.chunks, args.seed)
        table = await pool.fetchval("SELECT table_name FROM embedding_spaces WHERE model_key = $1", MODEL)
        analyses = await pool.fetchval(
            "SELECT autoanalyze_count + analyze_count FROM pg_stat_user_tables WHERE relname = 'chunks'"
        )
        print(f"{await pool.fetchval('SHOW server_version')}, {args.chunks} chunks, chunks analysed {analyses} times")
        scope = Scope.build(SearchFilters(), None, first_param=3)
        print("| statement | p50 ms | p95 ms | buffers (median) | chunk rows read (median) |")
        print("|---|---:|---:|---:|---:|")
        async with pool.acquire() as connection, connection.transaction(isolation="repeatable_read", readonly=True):
            await connection.execute(f"SET LOCAL hnsw.ef_search = {EF}")
            for name, sql in statements(table, scope).items():
                params = [] if name == "bare" else scope.params
                latencies, buffers, chunk_rows = [], [], []
                for number, query in enumerate([*queries[:5], *queries]):
                    started = time.perf_counter()
                    await connection.fetch(sql, query, LIMIT, *params)
                    if number >= 5:
                        latencies.append((time.perf_counter() - started) * 1000)
                for query in queries[:10]:
                    explain = f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"
                    explained = await connection.fetchval(explain, query, LIMIT, *params)
                    plan = json.loads(explained)[0]["Plan"]
                    buffers.append(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])
                    chunk_rows.append(rows_read(plan, "chunks"))
                p95 = float(np.percentile(latencies, 95))
                print(
                    f"| {name} | {statistics.median(latencies):.1f} | {p95:.1f} | {statistics.median(buffers):.0f}"
                    f" | {statistics.median(chunk_rows):.0f} |"
                )
        store = SearchStore(pool, ef_search=EF)
        latencies = []
        for number, query in enumerate([*queries[:5], *queries]):
            started = time.perf_counter()
            async with store.snapshot() as snapshot:
                await snapshot.vector_leg(table, query, LIMIT, scope)
            if number >= 5:
                latencies.append((time.perf_counter() - started) * 1000)
        p95 = float(np.percentile(latencies, 95))
        print(f"| vector_leg in its snapshot | {statistics.median(latencies):.1f} | {p95:.1f} | | |")
        print(f"load average {os.getloadavg()}")
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=8500)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/ragstream-vector-cost"))
    args = parser.parse_args()
    if dsn := os.environ.get("DATABASE_URL"):
        asyncio.run(bench(dsn, args))
        return
    with EmbeddedPostgres(args.data_dir) as server:
        asyncio.run(bench(server.dsn, args))


if __name__ == "__main__":
    main()
