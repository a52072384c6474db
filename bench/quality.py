"""Retrieval quality on InsuranceQA v2: nDCG@10 and Recall@10 of the keyword leg, the vector leg and
the fused result, in English and in Chinese.

The 27,413 answers of ``insuranceqa-data==1.2`` (``pip install insuranceqa-data==1.2``) are indexed
as one short document each through the real pipeline code (``Parser`` → ``MarkdownChunker`` → local
embedder via ``embedding_text`` → ``IndexService`` / ``DocumentStore.commit_document``), one database
per language on a private PostgreSQL. The queries of a split (``valid`` unless told: ``test`` is
reserved for release figures) then run through ``SearchStore.keyword_leg`` (BM25 and ts_rank_cd),
``SearchStore.vector_leg`` and ``HybridRetriever.search``, and are scored against the judgments
(binary relevance; a query has 1-11 relevant answers). Results are per document: a long answer split
into several chunks counts once, at its best rank.

    source /tmp/wtenv && /work/main/.venv/bin/python bench/quality.py            # both languages
    ... bench/quality.py --lang en --limit 3000 --queries 300                    # a quick iteration
    ... bench/quality.py --tune                                                  # + the BM25 and RRF grids

The index is kept in ``--data-dir`` (one database per language and corpus size), so a second run
only queries. ``--tune`` scores every (k1, b) of the BM25 grid from one pass of term statistics per
query (the same formula as the SQL, checked against it) and every RRF (k, weights) from the two leg
rankings; the figures reported for the chosen settings always come from the real SQL and retriever.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from ragstream.chunking import MarkdownChunker
from ragstream.embedding.base import TextKind, Vectors
from ragstream.embedding.local import LocalUSEEmbedder
from ragstream.messages import ChunksEmbedded, DocumentHeader, pack_vectors
from ragstream.parsing import Parser
from ragstream.retrieval import HybridRetriever, RetrievalSettings, SearchRequest
from ragstream.retrieval.fusion import reciprocal_rank_fusion
from ragstream.retrieval.models import SearchFilters
from ragstream.segmentation import query_terms
from ragstream.stages.embed import embedding_text
from ragstream.stages.index import IndexService
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import connect_pool
from ragstream.storage.documents import DocumentStore, document_id
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.scope import Scope
from ragstream.storage.search import _BM25_TERMS, SearchStore

__all__ = ["main"]

CONNECTION = "insuranceqa"
TOP = 10
LEG = 30
# Published plain-BM25 nDCG@10 on this data (ARCHITECTURE.md, "Benchmarks and data").
REFERENCE_BM25 = {"en": 0.295, "zh": 0.210}
BM25_GRID_K1 = (0.4, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0)
BM25_GRID_B = (0.3, 0.5, 0.6, 0.75, 0.9, 1.0)
# The settings recommended from the tuning on `valid` (docs/retrieval-quality.md).
DEFAULT_K1, DEFAULT_B = 1.2, 0.75
DEFAULT_RRF_K, DEFAULT_KEYWORD_WEIGHT = 60, 1.0
RRF_GRID_K = (1, 5, 10, 20, 30, 45, 60, 100, 200)
RRF_GRID_KEYWORD_WEIGHT = (0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0, 20.0)


# --------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Query:
    qid: str
    text: str
    relevant: frozenset[str]


def load_data(lang: str, split: str, limit: int | None, queries: int | None) -> tuple[dict[str, str], list[Query]]:
    """Answers to index (answer id → text) and the split's queries with their relevant answer ids.

    With ``--limit`` the corpus is the judged answers of the selected queries plus the first answers
    by id up to ``limit``: smaller, so the figures are higher than on the full corpus.
    """
    import insuranceqa_data  # type: ignore[import-untyped]

    answers = {key: value[lang].strip() for key, value in insuranceqa_data.load_answers().items()}
    raw = insuranceqa_data.load_valid() if split == "valid" else insuranceqa_data.load_test()
    selected = [
        Query(qid, " ".join(item[lang].split()), frozenset(item["answers"]))
        for qid, item in sorted(raw.items(), key=lambda pair: int(pair[0]))
    ]
    if queries is not None:
        selected = selected[:queries]
    if limit is not None:
        keep = {answer for query in selected for answer in query.relevant}
        for key in sorted(answers, key=int):
            if len(keep) >= limit:
                break
            keep.add(key)
        answers = {key: answers[key] for key in keep}
    return answers, selected


# ------------------------------------------------------------------------------------------- ingest


async def ingest(pool: asyncpg.Pool, embedder: LocalUSEEmbedder, answers: dict[str, str], batch: int = 256) -> float:
    """Index the answers not indexed yet; returns the seconds spent (0 when all were there)."""
    store = DocumentStore(pool)
    await store.ensure_connection(CONNECTION, "folder", "InsuranceQA v2 answers")
    done = set(await store.committed(CONNECTION))
    todo = sorted((key for key in answers if key not in done), key=int)
    if not todo:
        return 0.0
    parser, chunker, indexer = Parser(1 << 20), MarkdownChunker(), IndexService(store)
    started = time.perf_counter()
    pending: asyncio.Task[None] | None = None

    async def commit(messages: list[ChunksEmbedded]) -> None:
        for message in messages:
            await indexer.run(message)

    for start in range(0, len(todo), batch):
        documents = []
        for key in todo[start : start + batch]:
            content = answers[key].encode()
            parsed = parser.run(content, "text/plain", "")
            header = DocumentHeader(
                document_id=document_id(CONNECTION, key),
                connection_id=CONNECTION,
                external_id=key,
                version=await store.next_version(),
                content_hash=hashlib.sha256(content).hexdigest(),
                title=parsed.title,
                source=f"answers/{key}",
                media_type="text/plain",
            )
            documents.append((header, chunker.run(parsed)))
        texts = [embedding_text(header, chunk) for header, chunks in documents for chunk in chunks]
        vectors = await embedder.embed(texts)  # overlaps with the commit of the previous batch
        messages, offset = [], 0
        for header, chunks in documents:
            part = vectors[offset : offset + len(chunks)]
            offset += len(chunks)
            messages.append(
                ChunksEmbedded(
                    header=header,
                    batch_index=0,
                    batch_count=1,
                    chunk_count=len(chunks),
                    chunks=chunks,
                    model_key=embedder.model_key,
                    dimension=embedder.dimension,
                    vectors=pack_vectors(part),
                )
            )
        if pending is not None:
            await pending
        pending = asyncio.create_task(commit(messages))
        done_count = start + len(documents)
        rate = done_count / (time.perf_counter() - started)
        print(f"  indexed {done_count}/{len(todo)} ({rate:.0f}/s)", file=sys.stderr, flush=True)
    if pending is not None:
        await pending
    await pool.execute("ANALYZE")
    return time.perf_counter() - started


# ------------------------------------------------------------------------------------------ metrics


def score(ranked: Sequence[str], relevant: frozenset[str], k: int = TOP) -> tuple[float, float]:
    """nDCG@k and Recall@k of a ranking of answer ids: binary relevance, repeats count once."""
    unique = list(dict.fromkeys(ranked))[:k]
    dcg = sum(1 / math.log2(rank + 2) for rank, answer in enumerate(unique) if answer in relevant)
    ideal = sum(1 / math.log2(rank + 2) for rank in range(min(len(relevant), k)))
    return dcg / ideal, sum(answer in relevant for answer in unique) / len(relevant)


@dataclass
class Run:
    """One system's answer rankings for every query, and how long each query took."""

    rankings: list[list[str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def metrics(self, queries: Sequence[Query]) -> dict[str, float]:
        pairs = [score(ranking, query.relevant) for ranking, query in zip(self.rankings, queries, strict=True)]
        out = {
            "ndcg@10": round(statistics.fmean(pair[0] for pair in pairs), 4),
            "recall@10": round(statistics.fmean(pair[1] for pair in pairs), 4),
        }
        if self.seconds:
            ms = sorted(1000 * s for s in self.seconds)
            out["p50_ms"] = round(ms[len(ms) // 2], 1)
            out["p95_ms"] = round(ms[int(len(ms) * 0.95)], 1)
        return out


class QueryVectors:
    """The local embedder with every query embedded once, in batches, before the timed runs.

    The retriever embeds one query per search; the vectors are the same, only the timing of the
    fused run then leaves out the embedder (reported separately as ``embed_query_ms``).
    """

    def __init__(self, embedder: LocalUSEEmbedder) -> None:
        self._embedder = embedder
        self._vectors: dict[str, np.ndarray] = {}

    @property
    def model_key(self) -> str:
        return self._embedder.model_key

    @property
    def dimension(self) -> int:
        return self._embedder.dimension

    async def prepare(self, texts: Sequence[str]) -> float:
        started = time.perf_counter()
        vectors = await self._embedder.embed(list(texts), kind="query")
        self._vectors.update(zip(texts, vectors, strict=True))
        return (time.perf_counter() - started) / max(len(texts), 1)

    def __getitem__(self, text: str) -> np.ndarray:
        return self._vectors[text]

    async def warm_up(self) -> None:
        await self._embedder.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if all(text in self._vectors for text in texts):
            return np.stack([self._vectors[text] for text in texts]).astype(np.float32)
        return await self._embedder.embed(texts, kind)

    async def aclose(self) -> None:
        pass


async def timed_legs(queries: Sequence[Query], call: Any, answer_of: dict[str, str]) -> tuple[Run, list[list[str]]]:
    """Run ``call(index)`` for every query: the answer ranking (for the metrics) and the chunk ids."""
    run, chunk_lists = Run(), []
    for index in range(len(queries)):
        started = time.perf_counter()
        chunks = await call(index)
        run.seconds.append(time.perf_counter() - started)
        chunk_lists.append(chunks)
        run.rankings.append([answer_of[chunk] for chunk in chunks if chunk in answer_of])
    return run, chunk_lists


def answers_of(chunks: Sequence[str], answer_of: dict[str, str]) -> list[str]:
    return [answer_of[chunk] for chunk in chunks if chunk in answer_of]


# ---------------------------------------------------------------------------------------- exact kNN


async def exact_neighbours(pool: asyncpg.Pool, table: str, queries: np.ndarray, k: int) -> list[list[str]]:
    """Brute-force cosine top k over every stored vector, in numpy: the ground truth for HNSW."""
    rows = await pool.fetch(f"SELECT chunk_id, embedding FROM {table} ORDER BY chunk_id")
    ids = np.array([row["chunk_id"] for row in rows])
    matrix = np.stack([np.asarray(row["embedding"].to_numpy(), dtype=np.float32) for row in rows])
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    out: list[list[str]] = []
    for start in range(0, len(queries), 256):
        block = queries[start : start + 256]
        block = block / np.linalg.norm(block, axis=1, keepdims=True)
        similarity = block @ matrix.T
        top = np.argpartition(-similarity, k, axis=1)[:, :k]
        for row, candidates in zip(similarity, top, strict=True):
            ordered = candidates[np.lexsort((ids[candidates], -row[candidates]))]
            out.append(list(ids[ordered]))
    return out


# ------------------------------------------------------------------------------------------ BM25 grid

# The candidate rows of SearchStore's BM25 statement, grouped per query lexeme: what the score is
# computed from.
_BM25_FEATURES = f"""
    WITH q AS MATERIALIZED ({_BM25_TERMS}),
    hits AS (
        SELECT c.id, c.lexeme_count AS dl, m.lexeme, greatest(cardinality(m.positions), 1) AS tf
        FROM q, chunks c {{joins}}, unnest(ts_filter(setweight(c.search_vector, 'B', q.lexemes), '{{{{b}}}}')) AS m
        WHERE q.query IS NOT NULL AND c.search_vector @@ q.query AND {{scope}} AND m.lexeme = ANY(q.lexemes)
    )
    SELECT lexeme, array_agg(id ORDER BY id) AS ids, array_agg(tf ORDER BY id) AS tfs,
           array_agg(dl ORDER BY id) AS dls
    FROM hits GROUP BY lexeme
"""


def bm25_top(
    groups: Sequence[tuple[list[str], np.ndarray, np.ndarray]], n: float, avgdl: float, k1: float, b: float, k: int
) -> list[str]:
    """The top k chunk ids by the SQL's BM25 formula (ties by id, as in SQL), in numpy."""
    if not groups:
        return []
    ids = np.concatenate([np.asarray(group[0]) for group in groups])
    unique, inverse = np.unique(ids, return_inverse=True)
    tf = np.concatenate([group[1] for group in groups]).astype(np.float64)
    dl = np.concatenate([group[2] for group in groups]).astype(np.float64)
    df = np.concatenate([np.full(len(group[0]), float(len(group[0]))) for group in groups])
    idf = np.log(1 + (np.maximum(n, df) - df + 0.5) / (df + 0.5))
    contribution = idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))
    scores = np.bincount(inverse, weights=contribution, minlength=len(unique))
    order = np.argsort(-scores, kind="stable")[:k]  # unique is sorted: a stable sort breaks ties by id
    return list(unique[order])


async def tune_bm25(
    pool: asyncpg.Pool, terms: Sequence[list[str]], queries: Sequence[Query], answer_of: dict[str, str]
) -> dict[tuple[float, float], dict[str, float]]:
    """nDCG@10 / Recall@10 of every (k1, b) in the grid, from one statement per query."""
    scope = Scope.build(SearchFilters(), None, first_param=2)
    stats = await pool.fetchrow("SELECT count(*)::float8 AS n, avg(lexeme_count)::float8 AS avgdl FROM chunks")
    assert stats is not None
    sql = _BM25_FEATURES.format(joins=scope.joins, scope=scope.sql)
    grid = list(itertools.product(BM25_GRID_K1, BM25_GRID_B))
    runs = {params: Run() for params in grid}
    for query_terms_ in terms:
        rows = await pool.fetch(sql, query_terms_, *scope.params) if query_terms_ else []
        groups = [(list(row["ids"]), np.asarray(row["tfs"]), np.asarray(row["dls"])) for row in rows]
        for k1, b in grid:
            top = bm25_top(groups, stats["n"], stats["avgdl"], k1, b, LEG)
            runs[(k1, b)].rankings.append(answers_of(top, answer_of))
    return {params: run.metrics(queries) for params, run in runs.items()}


# --------------------------------------------------------------------------------------- plain BM25


def plain_bm25(answers: dict[str, str], queries: Sequence[Query], lang: str, k1: float = 1.2, b: float = 0.75) -> Run:
    """The reference: BM25 over lower-cased word tokens (en) or character bigrams (zh), no stemming
    and no stop words, in Python; to check that the published figures carry over to this split."""
    import re
    from collections import Counter

    word = re.compile(r"\w+")
    cjk = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")

    def tokens(text: str) -> list[str]:
        text = text.lower()
        if lang == "en":
            return word.findall(text)
        out: list[str] = []
        for token in word.findall(text):
            for run_ in cjk.findall(token) or []:
                out.extend(run_[i : i + 2] for i in range(max(len(run_) - 1, 1)))
            out.extend(piece for piece in cjk.split(token) if piece)
        return out

    keys = sorted(answers, key=int)
    postings: dict[str, list[tuple[int, int]]] = {}
    lengths = np.zeros(len(keys))
    for index, key in enumerate(keys):
        counts = Counter(tokens(answers[key]))
        lengths[index] = sum(counts.values())
        for token, count in counts.items():
            postings.setdefault(token, []).append((index, count))
    arrays = {
        token: (np.array([p[0] for p in items]), np.array([p[1] for p in items], dtype=np.float64))
        for token, items in postings.items()
    }
    avgdl, n = float(lengths.mean()), len(keys)
    run = Run()
    for query in queries:
        scores = np.zeros(len(keys))
        for token in set(tokens(query.text)):
            if token not in arrays:
                continue
            docs, tf = arrays[token]
            idf = math.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
            scores[docs] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[docs] / avgdl))
        top = np.argsort(-scores, kind="stable")[:TOP]
        run.rankings.append([keys[i] for i in top if scores[i] > 0])
    return run


# --------------------------------------------------------------------------------------- evaluation


async def evaluate(
    pool: asyncpg.Pool,
    embedder: LocalUSEEmbedder,
    answers: dict[str, str],
    queries: list[Query],
    lang: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    scope = Scope.build(SearchFilters(), None, first_param=3)
    rows = await pool.fetch("SELECT c.id, d.external_id FROM chunks c JOIN documents d ON d.id = c.document_id")
    answer_of = {row["id"]: row["external_id"] for row in rows}
    report: dict[str, Any] = {"chunks": len(answer_of)}
    vectors = QueryVectors(embedder)
    report["embed_query_ms"] = round(1000 * await vectors.prepare([query.text for query in queries]), 1)
    terms = [query_terms(query.text) for query in queries]
    runs: dict[str, Run] = {}

    def say(name: str) -> None:
        print(f"  {name}: {runs[name].metrics(queries)}", file=sys.stderr, flush=True)

    runs["keyword: plain BM25 reference (Python)"] = plain_bm25(answers, queries, lang)
    say("keyword: plain BM25 reference (Python)")

    store = SearchStore(pool, ef_search=args.ef_search)
    table = await store.embedding_table(embedder.model_key)
    assert table is not None
    runs["vector: HNSW (vector_leg)"], vector_chunks = await timed_legs(
        queries, lambda i: store.vector_leg(table, vectors[queries[i].text], LEG, scope), answer_of
    )
    say("vector: HNSW (vector_leg)")
    exact = await exact_neighbours(pool, table, np.stack([vectors[q.text] for q in queries]), LEG)
    runs["vector: exact kNN"] = Run([answers_of(ids, answer_of) for ids in exact])
    say("vector: exact kNN")
    report["hnsw_recall"] = {
        f"@{k}": round(
            statistics.fmean(
                len(set(v[:k]) & set(e[:k])) / max(min(k, len(e)), 1) for v, e in zip(vector_chunks, exact, strict=True)
            ),
            4,
        )
        for k in (10, LEG)
    }

    ts_rank = SearchStore(pool, keyword_ranking="ts_rank")
    runs["keyword: ts_rank_cd"], _ = await timed_legs(
        queries, lambda i: ts_rank.keyword_leg(terms[i], LEG, scope), answer_of
    )
    say("keyword: ts_rank_cd")

    async def bm25(k1: float, b: float, label: str = "") -> list[list[str]]:
        keyword = SearchStore(pool, keyword_ranking="bm25", bm25_k1=k1, bm25_b=b)
        name = f"keyword: BM25 k1={k1} b={b}{label}"
        runs[name], chunk_lists = await timed_legs(
            queries, lambda i: keyword.keyword_leg(terms[i], LEG, scope), answer_of
        )
        say(name)
        return chunk_lists

    k1, b, rrf_k, keyword_weight = args.k1, args.b, args.rrf_k, args.keyword_weight
    keyword_lists = await bm25(k1, b)
    if args.tune:
        grid = await tune_bm25(pool, terms, queries, answer_of)
        report["bm25_grid"] = [{"k1": k1_, "b": b_, **m} for (k1_, b_), m in grid.items()]
        if (k1, b) in grid:  # the numpy scoring must agree with the SQL it stands in for
            sql = Run([answers_of(ids, answer_of) for ids in keyword_lists]).metrics(queries)
            report["bm25_grid_check"] = {"sql": sql, "numpy": grid[(k1, b)]}
        best = max(grid, key=lambda params: (grid[params]["ndcg@10"], grid[params]["recall@10"]))
        report["bm25_best"] = {"k1": best[0], "b": best[1], **grid[best]}
        print(f"  BM25 grid best: {report['bm25_best']}", file=sys.stderr, flush=True)
        if best != (k1, b):
            k1, b = best
            keyword_lists = await bm25(k1, b, " (tuned)")

        fusion = {}
        for k, weight in itertools.product(RRF_GRID_K, RRF_GRID_KEYWORD_WEIGHT):
            run = Run()
            for v, kw in zip(vector_chunks, keyword_lists, strict=True):
                fused = reciprocal_rank_fusion([v, kw], weights=[1.0, weight], k=k)
                run.rankings.append(answers_of([chunk for chunk, _ in fused[:TOP]], answer_of))
            fusion[(k, weight)] = run.metrics(queries)
        rrf_k, keyword_weight = max(fusion, key=lambda p: (fusion[p]["ndcg@10"], fusion[p]["recall@10"]))
        report["rrf_grid"] = [{"k": k, "keyword_weight": w, **m} for (k, w), m in fusion.items()]
        report["rrf_best"] = {"k": rrf_k, "keyword_weight": keyword_weight, **fusion[(rrf_k, keyword_weight)]}
        print(f"  RRF grid best: {report['rrf_best']}", file=sys.stderr, flush=True)
    report["settings"] = {
        "bm25_k1": k1,
        "bm25_b": b,
        "rrf_k": rrf_k,
        "vector_weight": 1.0,
        "keyword_weight": keyword_weight,
        "leg_size": LEG,
        "ef_search": args.ef_search,
    }

    fused_settings = {(60, 1.0): "RRF k=60, weights 1/1 (previous defaults)"}
    fused_settings.setdefault((rrf_k, keyword_weight), f"RRF k={rrf_k}, weights 1/{keyword_weight} (vector/keyword)")
    for (k, weight), name in fused_settings.items():
        retriever = HybridRetriever(
            SearchStore(pool, ef_search=args.ef_search, keyword_ranking="bm25", bm25_k1=k1, bm25_b=b),
            vectors,
            CitationStore(pool),
            settings=RetrievalSettings(leg_size=LEG, rrf_k=k, vector_weight=1.0, keyword_weight=weight),
        )

        async def search(i: int, retriever: HybridRetriever = retriever) -> list[str]:
            response = await retriever.search(SearchRequest(query=queries[i].text, top_k=TOP))
            return [result.chunk_id for result in response.results]

        runs[f"fused: {name}"], _ = await timed_legs(queries, search, answer_of)
        say(f"fused: {name}")
    report["runs"] = {name: run.metrics(queries) for name, run in runs.items()}
    return report


def write_results(reports: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for report in reports:
        print(
            f"\n{report['lang']}: {report['answers']} answers ({report['chunks']} chunks), "
            f"{report['queries']} {args.split} queries; HNSW recall vs exact {report['hnsw_recall']}"
        )
        print(f"  {'run':58} {'nDCG@10':>8} {'R@10':>7} {'p50 ms':>7} {'p95 ms':>7}")
        for name, m in report["runs"].items():
            print(
                f"  {name:58} {m['ndcg@10']:8.4f} {m['recall@10']:7.4f}"
                f" {m.get('p50_ms', float('nan')):7.1f} {m.get('p95_ms', float('nan')):7.1f}"
            )
        print(f"  plain BM25, published (test split): nDCG@10 {REFERENCE_BM25[report['lang']]}")
        for key in ("bm25_best", "rrf_best"):
            if key in report:
                print(f"  {key}: {report[key]}")
    suffix = f"-limit{args.limit}" if args.limit else ""
    suffix += f"-q{args.queries}" if args.queries else ""
    out = args.out or Path(__file__).parent / "results" / f"quality-{args.split}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(out.read_text()) if out.exists() else {}
    existing.update({report["lang"]: report for report in reports})
    existing["command"] = " ".join(["bench/quality.py", *sys.argv[1:]])
    existing["reference_plain_bm25_ndcg@10_test"] = REFERENCE_BM25
    out.write_text(json.dumps(existing, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwritten {out}")


# --------------------------------------------------------------------------------------------- main


async def database(base_dsn: str, name: str) -> str:
    """The DSN of database ``name`` on the server of ``base_dsn``, created if missing."""
    connection = await asyncpg.connect(base_dsn)
    try:
        if not await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    return base_dsn.rsplit("/", 1)[0] + f"/{name}"


async def run_language(base_dsn: str, lang: str, args: argparse.Namespace) -> dict[str, Any]:
    answers, queries = load_data(lang, args.split, args.limit, args.queries)
    name = f"quality_{lang}" + (f"_{args.limit}" if args.limit else "")
    pool = await connect_pool(await database(base_dsn, name), max_size=4)
    embedder = LocalUSEEmbedder(threads=args.threads)
    try:
        print(f"[{lang}] {len(answers)} answers, {len(queries)} {args.split} queries", file=sys.stderr)
        seconds = await ingest(pool, embedder, answers)
        report: dict[str, Any] = {"lang": lang, "answers": len(answers), "queries": len(queries)}
        if seconds:
            report["ingest_seconds"] = round(seconds, 1)
        if args.ingest_only:
            return report
        report.update(await evaluate(pool, embedder, answers, queries, lang, args))
        return report
    finally:
        await embedder.aclose()
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lang", nargs="+", choices=("en", "zh"), default=["en", "zh"])
    parser.add_argument("--split", choices=("valid", "test"), default="valid", help="test is reserved for releases")
    parser.add_argument("--limit", type=int, help="index only about this many answers (quick iterations)")
    parser.add_argument("--queries", type=int, help="only the first N queries of the split")
    parser.add_argument("--tune", action="store_true", help="also search the BM25 (k1, b) and RRF (k, weight) grids")
    parser.add_argument("--ingest-only", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="embedder threads")
    parser.add_argument("--k1", type=float, default=DEFAULT_K1, help="BM25 k1 of the keyword leg")
    parser.add_argument("--b", type=float, default=DEFAULT_B, help="BM25 b of the keyword leg")
    parser.add_argument("--rrf-k", type=int, default=DEFAULT_RRF_K)
    parser.add_argument("--keyword-weight", type=float, default=DEFAULT_KEYWORD_WEIGHT, help="vector weight is 1")
    parser.add_argument("--ef-search", type=int, default=100, help="hnsw.ef_search of the vector leg")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "ragstream-quality")
    parser.add_argument("--out", type=Path, help="JSON results (default bench/results/quality-<split>.json)")
    args = parser.parse_args()

    async def run(dsn: str) -> list[dict[str, Any]]:
        return [await run_language(dsn, lang, args) for lang in args.lang]

    if dsn := os.environ.get("DATABASE_URL"):
        reports = asyncio.run(run(dsn))
    else:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        with EmbeddedPostgres(args.data_dir) as server:
            reports = asyncio.run(run(server.dsn))
    if not args.ingest_only:
        write_results(reports, args)


if __name__ == "__main__":
    main()
