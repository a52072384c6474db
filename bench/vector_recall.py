"""Recall and latency of the HNSW vector leg against exact search, unfiltered and under selective scopes.

Builds a synthetic index straight into the ragstream schema (COPY, then one HNSW build), so every
SQL path the retriever uses runs unchanged:

* chunks: ``--chunks`` unit vectors of ``--dim`` dimensions with the structure of text embeddings
  (topics, documents within topics, chunks within documents, in a low-dimensional latent space
  projected to ``--dim``, plus ``--noise``, calibrated on USE embeddings: docs/vector-leg.md);
  10 chunks per document;
* scopes: 100 connections and 100 ACL groups assigned at random (a scope of 1, 5 or 20 of them
  selects 1 %, 5 %, 20 % of the chunks, independently of the vectors), and 100 knowledge bases that
  follow the topics (a 5 % knowledge-base scope is *correlated*: most queries fall outside it, the
  hard case for an index that filters after its scan);
* queries: perturbed chunk vectors; ground truth by brute force in numpy over the visible chunks.

For each ef_search, the plain post-filtered HNSW query (``SET hnsw.ef_search``, ``WHERE scope``,
``ORDER BY distance LIMIT 30``) is measured, then an exact scan in SQL, then
``SearchStore.vector_leg`` (the policy in production). Recall@30 = |returned ∩ exact top 30| /
min(30, visible).

    .venv/bin/python bench/vector_recall.py

``DATABASE_URL`` wins (the bench then writes ``bench-*`` connections and an ``embeddings_bench_*``
table into that database); otherwise a private server keeps its data in ``--data-dir``, so a second
run reuses the built index.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from ragstream.core.search import Principal, SearchFilters
from ragstream.storage.database import connect_pool
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.scope import Scope
from ragstream.storage.search import SearchStore, _scope_probe

__all__ = ["main"]

CHUNKS_PER_DOCUMENT = 10
BUCKETS = 100  # connections, groups, knowledge bases
LIMIT = 30
LATENT = 48
WARMUP = 5
# pgvector 0.8 iterative scans measured: (ef_search, visible rows wanted, hnsw.max_scan_tuples).
ITERATIVE = [(100, 30, 2000), (100, 100, 5000), (200, 100, 10000)]


@dataclass(frozen=True)
class Corpus:
    vectors: np.ndarray  # (n, dim) float32, unit length
    connection: np.ndarray  # bucket of each chunk
    group: np.ndarray
    knowledge_base: np.ndarray
    queries: np.ndarray


@dataclass(frozen=True)
class Case:
    name: str
    filters: SearchFilters
    principal: Principal
    visible: Callable[[Corpus], np.ndarray]


def synthesize(chunks: int, dim: int, queries: int, seed: int, noise: float) -> Corpus:
    rng = np.random.default_rng(seed)
    documents = chunks // CHUNKS_PER_DOCUMENT
    topics = 400
    topic_of_document = rng.integers(0, topics, documents)
    centres = rng.normal(size=(topics, LATENT))
    document_latent = centres[topic_of_document] + 0.6 * rng.normal(size=(documents, LATENT))
    latent = np.repeat(document_latent, CHUNKS_PER_DOCUMENT, axis=0) + 0.5 * rng.normal(size=(chunks, LATENT))
    projection = rng.normal(size=(LATENT, dim)) / np.sqrt(LATENT)
    vectors = latent @ projection + noise * rng.normal(size=(chunks, dim))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    picked = rng.integers(0, chunks, queries)
    query_latent = latent[picked] + 0.7 * rng.normal(size=(queries, LATENT))
    query_vectors = query_latent @ projection + noise * rng.normal(size=(queries, dim))
    query_vectors /= np.linalg.norm(query_vectors, axis=1, keepdims=True)
    per_chunk = np.repeat
    return Corpus(
        vectors.astype(np.float32),
        per_chunk(rng.integers(0, BUCKETS, documents), CHUNKS_PER_DOCUMENT),
        per_chunk(rng.integers(0, BUCKETS, documents), CHUNKS_PER_DOCUMENT),
        per_chunk(topic_of_document % BUCKETS, CHUNKS_PER_DOCUMENT),
        query_vectors.astype(np.float32),
    )


def cases() -> list[Case]:
    everyone = Principal(user="bench", groups=[f"g{g}" for g in range(BUCKETS)])
    result = [Case("all", SearchFilters(), everyone, lambda c: np.ones(len(c.vectors), dtype=bool))]
    for share in (20, 5, 1):
        result.append(
            Case(
                f"connection {share}%",
                SearchFilters(connection_ids=[f"bench-{b}" for b in range(share)]),
                everyone,
                lambda c, share=share: c.connection < share,  # type: ignore[misc]
            )
        )
        result.append(
            Case(
                f"acl {share}%",
                SearchFilters(),
                Principal(user="bench", groups=[f"g{g}" for g in range(share)]),
                lambda c, share=share: c.group < share,  # type: ignore[misc]
            )
        )
    result.append(
        Case(
            "kb 5% (correlated)",
            SearchFilters(knowledge_bases=[f"kb{b}" for b in range(5)]),
            everyone,
            lambda c: c.knowledge_base < 5,
        )
    )
    return result


async def load(pool: asyncpg.Pool, corpus: Corpus, table: str) -> None:
    """Write the corpus into the ragstream schema unless this exact corpus is already there."""
    if await pool.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        return
    n, dim = corpus.vectors.shape
    documents = n // CHUNKS_PER_DOCUMENT
    started = time.perf_counter()
    async with pool.acquire() as connection, connection.transaction():
        # One bench corpus at a time: drop an earlier one (other seed, size or noise).
        earlier = "SELECT table_name FROM embedding_spaces WHERE model_key LIKE 'embeddings_bench_%'"
        for row in await connection.fetch(earlier):
            await connection.execute(f"DROP TABLE {row['table_name']}")
        await connection.execute("DELETE FROM embedding_spaces WHERE model_key LIKE 'embeddings_bench_%'")
        await connection.execute("DELETE FROM connections WHERE id LIKE 'bench-%'")
        await connection.executemany(
            "INSERT INTO connections (id, platform, name) VALUES ($1, 'bench', $1)",
            [(f"bench-{b}",) for b in range(BUCKETS)],
        )
        await connection.copy_records_to_table(
            "documents",
            columns=[
                "id",
                "connection_id",
                "external_id",
                "title",
                "source",
                "media_type",
                "content_hash",
                "version",
                "status",
                "chunk_count",
                "knowledge_base",
            ],
            records=[
                (
                    f"bd{d}",
                    f"bench-{corpus.connection[d * CHUNKS_PER_DOCUMENT]}",
                    f"doc{d}",
                    f"Document {d}",
                    f"doc{d}.md",
                    "text/markdown",
                    "",
                    1,
                    "indexed",
                    CHUNKS_PER_DOCUMENT,
                    f"kb{corpus.knowledge_base[d * CHUNKS_PER_DOCUMENT]}",
                )
                for d in range(documents)
            ],
        )
        # tsvector has no binary COPY encoder: insert from arrays instead.
        await connection.execute(
            "INSERT INTO chunks (id, document_id, ordinal, heading, text, search_vector, acl)"
            " SELECT 'bc' || i, 'bd' || (i / $2), i % $2, '', 'chunk ' || i, ''::tsvector, ARRAY['group:g' || g]"
            " FROM unnest($1::int[]) WITH ORDINALITY AS t(g, o), LATERAL (SELECT (o - 1)::int AS i) AS x",
            corpus.group.tolist(),
            CHUNKS_PER_DOCUMENT,
        )
        await connection.execute(
            f"CREATE TABLE {table} (chunk_id text PRIMARY KEY REFERENCES chunks (id) ON DELETE CASCADE,"
            f" embedding vector({dim}) NOT NULL)"
        )
        await connection.copy_records_to_table(
            table, columns=["chunk_id", "embedding"], records=[(f"bc{i}", corpus.vectors[i]) for i in range(n)]
        )
        await connection.execute("SET LOCAL maintenance_work_mem = '1GB'")
        await connection.execute(f"CREATE INDEX {table}_hnsw ON {table} USING hnsw (embedding vector_cosine_ops)")
        await connection.execute(
            "INSERT INTO embedding_spaces (model_key, dimension, table_name) VALUES ($1, $2, $1)", table, dim
        )
    for name in ("connections", "documents", "chunks", table):
        await pool.execute(f"ANALYZE {name}")
    print(f"loaded {n} chunks and built HNSW (m=16, ef_construction=64) in {time.perf_counter() - started:.0f} s")


async def post_filtered(pool: asyncpg.Pool, table: str, vector: np.ndarray, scope: Scope, ef: int) -> list[str]:
    """The leg as it was: pgvector's HNSW scan, then the scope as a filter over what it found."""
    async with pool.acquire() as connection, connection.transaction():
        await connection.execute(f"SET LOCAL hnsw.ef_search = {ef}")
        rows = await connection.fetch(
            f"SELECT c.id FROM {table} e JOIN chunks c ON c.id = e.chunk_id {scope.joins}"
            f" WHERE {scope.sql} ORDER BY e.embedding <=> $1 LIMIT $2",
            vector,
            LIMIT,
            *scope.params,
        )
    return [row["id"] for row in rows]


async def iterative(
    pool: asyncpg.Pool, table: str, vector: np.ndarray, scope: Scope, ef: int, wanted: int, max_tuples: int
) -> list[str]:
    """pgvector 0.8's iterative index scan: the scan goes on until ``wanted`` rows passed the scope (or
    ``max_tuples`` were visited); the nearest 30 of them, sorted (relaxed_order is about in order).
    The scope is checked per candidate as the leg does, so that the index drives the scan."""
    async with pool.acquire() as connection, connection.transaction():
        await connection.execute(
            f"SET LOCAL hnsw.ef_search = {ef}; SET LOCAL hnsw.iterative_scan = relaxed_order;"
            f" SET LOCAL hnsw.max_scan_tuples = {max_tuples}"
        )
        rows = await connection.fetch(
            f"WITH nearest AS MATERIALIZED (SELECT e.chunk_id, e.embedding <=> $1 AS distance FROM {table} e"
            f"  CROSS JOIN LATERAL ({_scope_probe(scope, 'e.chunk_id')}) AS v"
            f"  ORDER BY e.embedding <=> $1 LIMIT {wanted})"
            " SELECT chunk_id FROM nearest ORDER BY distance, chunk_id LIMIT $2",
            vector,
            LIMIT,
            *scope.params,
        )
    return [row["chunk_id"] for row in rows]


def exact_top(corpus: Corpus, visible: np.ndarray, query: np.ndarray) -> list[str]:
    ids = np.flatnonzero(visible)
    distances = 1.0 - corpus.vectors[ids] @ query
    return [f"bc{i}" for i in ids[np.argsort(distances, kind="stable")[:LIMIT]]]


async def exact(pool: asyncpg.Pool, table: str, vector: np.ndarray, scope: Scope) -> list[str]:
    """Exact search in SQL: distances to every scoped row, sorted (no index can serve the ORDER BY)."""
    rows = await pool.fetch(
        f"WITH scoped AS MATERIALIZED (SELECT c.id, e.embedding <=> $1 AS distance FROM {table} e"
        f" JOIN chunks c ON c.id = e.chunk_id {scope.joins} WHERE {scope.sql})"
        " SELECT id FROM scoped ORDER BY distance, id LIMIT $2",
        vector,
        LIMIT,
        *scope.params,
    )
    return [row["id"] for row in rows]


def count_calls(store: SearchStore, counts: Counter[str]) -> None:
    """Count which paths ``vector_leg`` takes (HNSW scans, exact scans) by wrapping its helpers."""
    for name in ("_hnsw_scan", "_exact_scan"):
        inner = getattr(store, name)

        async def counted(*args: Any, inner: Any = inner, name: str = name) -> Any:
            counts[name] += 1
            return await inner(*args)

        setattr(store, name, counted)


async def measure(
    run: Callable[[np.ndarray], Awaitable[list[str]]], corpus: Corpus, visible: np.ndarray
) -> tuple[float, float, float]:
    """Mean recall@30, mean returned, p50 latency in ms."""
    for query in corpus.queries[:WARMUP]:  # warm the plan cache and buffers; not measured
        await run(query)
    recalls, returned, latencies = [], [], []
    for query in corpus.queries:
        started = time.perf_counter()
        ids = await run(query)
        latencies.append((time.perf_counter() - started) * 1000)
        truth = exact_top(corpus, visible, query)
        recalls.append(len(set(ids) & set(truth)) / max(1, len(truth)))
        returned.append(len(ids))
    return statistics.fmean(recalls), statistics.fmean(returned), statistics.median(latencies)


async def run_case(
    pool: asyncpg.Pool,
    store: SearchStore,
    table: str,
    corpus: Corpus,
    case: Case,
    efs: list[int],
    iterative_scans: bool,
) -> list[str]:
    """Table rows of one scope: post-filtered HNSW per ef_search, the exact scan, then ``vector_leg``."""
    visible = case.visible(corpus)
    scope = Scope.build(case.filters, case.principal, first_param=3)
    head = f"| {case.name} | {visible.mean():.1%} |"
    lines = []
    for ef in efs:
        recall, returned, p50 = await measure(partial(post_filtered, pool, table, scope=scope, ef=ef), corpus, visible)
        lines.append(f"{head} HNSW ef_search={ef}, post-filter | {recall:.3f} | {returned:.1f} | {p50:.1f} |")
    recall, returned, p50 = await measure(lambda q: exact(pool, table, q, scope), corpus, visible)
    lines.append(f"{head} exact scan | {recall:.3f} | {returned:.1f} | {p50:.1f} |")
    if iterative_scans:
        for ef, wanted, max_tuples in ITERATIVE:
            run = partial(iterative, pool, table, scope=scope, ef=ef, wanted=wanted, max_tuples=max_tuples)
            recall, returned, p50 = await measure(run, corpus, visible)
            method = f"HNSW iterative scan ef_search={ef}, {wanted} visible, max_scan_tuples={max_tuples}"
            lines.append(f"{head} {method} | {recall:.3f} | {returned:.1f} | {p50:.1f} |")
    counts: Counter[str] = Counter()
    count_calls(store, counts)

    async def vector_leg(query: np.ndarray) -> list[str]:
        return [hit.chunk_id for hit in await store.vector_leg(table, query, LIMIT, scope)]

    recall, returned, p50 = await measure(vector_leg, corpus, visible)
    calls = len(corpus.queries) + WARMUP
    per_query = {name: counts[name] / calls for name in ("_hnsw_scan", "_exact_scan")}
    paths = f"{per_query['_hnsw_scan']:.2f} HNSW + {per_query['_exact_scan']:.2f} exact per query"
    lines.append(f"{head} **vector_leg** ({paths}) | {recall:.3f} | {returned:.1f} | {p50:.1f} |")
    return lines


async def bench(dsn: str, args: argparse.Namespace) -> None:
    corpus = synthesize(args.chunks, args.dim, args.queries, args.seed, args.noise)
    table = f"embeddings_bench_{args.dim}_{args.chunks}_{args.seed}_{round(args.noise * 100)}"
    pool = await connect_pool(dsn, max_size=2)
    try:
        await load(pool, corpus, table)
        version = await pool.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        iterative_scans = tuple(int(part) for part in version.split(".")[:2]) >= (0, 8)
        print(
            f"{args.chunks} chunks, {args.dim}-d, noise {args.noise}, {args.queries} queries, vector_leg ef_search"
            f" {args.base_ef}; recall@{LIMIT} against exact search\n"
        )
        print("| scope | visible | method | recall@30 | returned | p50 ms |")
        print("|---|---:|---|---:|---:|---:|")
        for case in cases():
            if not args.only or case.name in args.only:
                store = SearchStore(pool, ef_search=args.base_ef)
                rows = await run_case(pool, store, table, corpus, case, args.ef, iterative_scans)
                print("\n".join(rows), flush=True)
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=30_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--noise", type=float, default=1.2, help="isotropic noise per dimension (see module doc)")
    parser.add_argument("--ef", type=int, nargs="*", default=[40, 100, 200, 400])
    parser.add_argument("--base-ef", type=int, default=100, help="SearchStore ef_search (settings.hnsw_ef_search)")
    parser.add_argument("--only", nargs="*", help="scope names to run")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/ragstream-vecbench"))
    parser.add_argument("--shared-buffers", default="1GB", help="for the private server only")
    args = parser.parse_args()
    if dsn := os.environ.get("DATABASE_URL"):
        asyncio.run(bench(dsn, args))
        return
    server = EmbeddedPostgres(args.data_dir)
    # The default 128 MB of shared buffers cannot hold the vectors (2 KB each) and the graph: every
    # exact scan would evict the index and the next HNSW scans would time disk reads.
    if asyncio.run(set_shared_buffers(server.start(), args.shared_buffers)):
        server.stop()
    try:
        asyncio.run(bench(server.start(), args))
    finally:
        server.stop()


async def set_shared_buffers(dsn: str, size: str) -> bool:
    """True when the setting changed (it takes a restart)."""
    connection = await asyncpg.connect(dsn)
    try:
        wanted = await connection.fetchval("SELECT pg_size_bytes($1)", size)
        current = await connection.fetchval("SELECT pg_size_bytes(current_setting('shared_buffers'))")
        if current == wanted:
            return False
        await connection.execute(f"ALTER SYSTEM SET shared_buffers = '{size}'")
        return True
    finally:
        await connection.close()


if __name__ == "__main__":
    main()
