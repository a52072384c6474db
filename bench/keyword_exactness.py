"""The keyword leg from impact-ordered postings against the exact BM25 scan on InsuranceQA v2.

The answers of ``insuranceqa-data==1.2`` are chunked as ``bench/quality.py`` chunks them (``Parser`` →
``MarkdownChunker``) and committed through ``DocumentStore.commit_document`` with placeholder vectors
(only the keyword leg runs), one database per language. Every query of the split then runs through
``SearchStore.keyword_leg`` twice, each in its own snapshot as the retriever runs it: with the postings
(the default) and with ``impact_ordered=False`` (every matching chunk scored). Printed per language:
top-10 overlap (chunks), nDCG@10 of both and the difference, the largest score difference at equal
rank, the path each query took, p50/p95 of both, and the load average.

``--scope small`` adds a connection of the first ``SMALL_ANSWERS`` answers again beside the corpus and
searches it alone: a scope holding a small share of the terms' postings, which the exact scan reads
scope first (``SELECTIVE_SCOPE``), where ``impact_ordered=False`` reads every match in the corpus.

    .venv/bin/pip install insuranceqa-data==1.2
    .venv/bin/python -m bench.keyword_exactness [--lang en zh] [--split valid] [--queries N] [--limit N] \
        [--scope all|small]

The postings side is built as the retriever builds it (``runtime.keyword_postings``): a query whose rounds
read deep is answered from its terms' whole lists (``WHOLE_LISTS`` in the paths).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from bench.quality import TOP, Query, answer_header, answers_of, database, load_data, score
from ragstream.chunking import MarkdownChunker
from ragstream.core.search import SearchFilters
from ragstream.parsing import Parser
from ragstream.runtime import keyword_postings
from ragstream.segmentation import query_terms
from ragstream.settings import Settings
from ragstream.storage.database import connect_pool
from ragstream.storage.documents import DocumentStore, document_id
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.scope import Scope
from ragstream.storage.search import Hit, SearchStore

__all__ = ["main"]

CONNECTION = "insuranceqa"
SMALL_CONNECTION = "insuranceqa-small"
SMALL_ANSWERS = 20
LEG = 30
PLACEHOLDER_MODEL = "placeholder-keyword-bench"


async def ingest(pool: asyncpg.Pool, answers: dict[str, str], workers: int = 4) -> tuple[float, dict[str, str]]:
    """Commit the answers not committed yet; the seconds spent and chunk id → answer id."""
    store = DocumentStore(pool)
    await store.ensure_connection(CONNECTION, "folder", "InsuranceQA v2 answers")
    done = set(await store.committed(CONNECTION))
    todo = sorted((key for key in answers if key not in done), key=int)
    parser, chunker = Parser(1 << 20), MarkdownChunker()
    vector = np.full((1, 8), 1 / np.sqrt(8), dtype=np.float32)
    started = time.perf_counter()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for key in todo:
        queue.put_nowait(key)

    async def worker() -> None:
        while not queue.empty():
            key = queue.get_nowait()
            content = answers[key].encode()
            parsed = parser.run(content, "text/plain", "")
            chunks = chunker.run(parsed)
            header = await answer_header(store, key, content, parsed.title)
            await store.commit_document(header, chunks, np.repeat(vector, len(chunks), axis=0), PLACEHOLDER_MODEL)
            left = queue.qsize()
            if left % 2000 == 0:
                print(f"  {len(todo) - left}/{len(todo)} committed", file=sys.stderr, flush=True)

    await asyncio.gather(*(worker() for _ in range(workers)))
    seconds = time.perf_counter() - started if todo else 0.0
    if todo:
        await pool.execute("ANALYZE")
    rows = await pool.fetch(
        "SELECT c.id, d.external_id FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = $1",
        CONNECTION,
    )
    return seconds, {row["id"]: row["external_id"] for row in rows}


async def commit_small_connection(pool: asyncpg.Pool, answers: dict[str, str]) -> None:
    """The first ``SMALL_ANSWERS`` answers again, as documents of a connection of their own."""
    store = DocumentStore(pool)
    await store.ensure_connection(SMALL_CONNECTION, "folder", "A few InsuranceQA v2 answers")
    parser, chunker = Parser(1 << 20), MarkdownChunker()
    vector = np.full((1, 8), 1 / np.sqrt(8), dtype=np.float32)
    done = set(await store.committed(SMALL_CONNECTION))
    for key in sorted(answers, key=int)[:SMALL_ANSWERS]:
        if key in done:
            continue
        content = answers[key].encode()
        parsed = parser.run(content, "text/plain", "")
        chunks = chunker.run(parsed)
        header = (await answer_header(store, key, content, parsed.title)).model_copy(
            update={"document_id": document_id(SMALL_CONNECTION, key), "connection_id": SMALL_CONNECTION}
        )
        await store.commit_document(header, chunks, np.repeat(vector, len(chunks), axis=0), PLACEHOLDER_MODEL)
    await pool.execute("ANALYZE")


async def leg(store: SearchStore, query: Query, scope: Scope) -> tuple[list[Hit], float]:
    started = time.perf_counter()
    async with store.snapshot() as snapshot:
        hits = await snapshot.keyword_leg(query_terms(query.text), LEG, scope, query=query.text)
    return hits, time.perf_counter() - started


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


async def compare(
    lang: str, pool: asyncpg.Pool, queries: list[Query], answer_of: dict[str, str], filters: SearchFilters
) -> dict[str, Any]:
    # The settings' BM25 parameters: the postings' reference (migration 0023) serves only those.
    defaults = Settings()
    bm25 = {"bm25_k1": defaults.bm25_k1, "bm25_b": defaults.bm25_b}
    # The postings as the retriever reads them: rounds, and whole term lists for the searches that read deep.
    fast = SearchStore(pool, postings=keyword_postings(defaults), **bm25)
    exact = SearchStore(pool, impact_ordered=False, **bm25)
    scope = Scope.build(filters, None, first_param=3)
    for store in (fast, exact):  # statistics cached, plans warm
        await leg(store, queries[0], scope)
    fast.keyword_paths.clear()
    overlap = counted = 0
    worst = 0.0
    ndcg: dict[str, list[float]] = {"postings": [], "exact": []}
    seconds: dict[str, list[float]] = {"postings": [], "exact": []}
    for index, query in enumerate(queries):
        # Alternating which runs first, so neither profits from the other's cache more.
        order = [("postings", fast), ("exact", exact)]
        if index % 2:
            order.reverse()
        hits: dict[str, list[Hit]] = {}
        for label, store in order:
            hits[label], took = await leg(store, query, scope)
            seconds[label].append(took)
            ndcg[label].append(score(answers_of([hit.chunk_id for hit in hits[label]], answer_of), query.relevant)[0])
        want, got = hits["exact"][:TOP], hits["postings"][:TOP]
        counted += len(want)
        overlap += len({hit.chunk_id for hit in want} & {hit.chunk_id for hit in got})
        worst = max([worst, *(abs(a.score - b.score) for a, b in zip(got, want, strict=False))])
    report = {
        "lang": lang,
        "scope": filters.model_dump(exclude_none=True),
        "queries": len(queries),
        "chunks": len(answer_of),
        "top10_overlap": overlap / counted if counted else 1.0,
        "ndcg10_postings": statistics.fmean(ndcg["postings"]),
        "ndcg10_exact": statistics.fmean(ndcg["exact"]),
        "ndcg10_delta": statistics.fmean(ndcg["postings"]) - statistics.fmean(ndcg["exact"]),
        "max_score_difference": worst,
        "paths": dict(fast.keyword_paths),
        "ms": {
            label: {"p50": 1000 * percentile(values, 0.5), "p95": 1000 * percentile(values, 0.95)}
            for label, values in seconds.items()
        },
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=1), flush=True)
    return report


async def run(base_dsn: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    reports = []
    for lang in args.lang:
        answers, queries = load_data(lang, args.split, args.limit, args.queries)
        name = f"keyword_exactness_{lang}" + (f"_{args.limit}" if args.limit else "")
        pool = await connect_pool(await database(base_dsn, name), max_size=6)
        try:
            seconds, answer_of = await ingest(pool, answers)
            print(f"{lang}: {len(answer_of)} chunks, ingest {seconds:.0f} s", file=sys.stderr, flush=True)
            filters = SearchFilters()
            if args.scope == "small":
                await commit_small_connection(pool, answers)
                filters = SearchFilters(connection_ids=[SMALL_CONNECTION])
            reports.append(await compare(lang, pool, queries, answer_of, filters))
        finally:
            await pool.close()
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lang", nargs="+", choices=("en", "zh"), default=["en", "zh"])
    parser.add_argument("--split", choices=("valid", "test"), default="valid")
    parser.add_argument("--limit", type=int, help="index only about this many answers")
    parser.add_argument("--queries", type=int, help="only the first N queries of the split")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "ragstream-keyword-exactness")
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--scope", choices=("all", "small"), default="all", help="small: a connection of a few answers")
    args = parser.parse_args()
    if dsn := os.environ.get("DATABASE_URL"):
        reports = asyncio.run(run(dsn, args))
    else:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        with EmbeddedPostgres(args.data_dir) as server:
            reports = asyncio.run(run(server.dsn, args))
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
