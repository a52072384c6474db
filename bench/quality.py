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

    make bench-quality  (or .venv/bin/python bench/quality.py)                   # both languages
    ... bench/quality.py --lang en --limit 3000 --queries 300                    # a quick iteration
    ... bench/quality.py --tune [bm25] [fusion]                                  # + the BM25 and/or fusion grids
    ... bench/quality.py --lang zh --provider onnx                               # BGE small zh instead of USE

The index is kept in ``--data-dir`` (one database per language, corpus size and embedding model), so a
second run only queries. ``--tune`` scores every (k1, b) of the BM25 grid from one pass of term statistics per
query (the same formula as the SQL, checked against it), and every RRF (k, weight), convex alpha and
distribution-based keyword share by the retriever's own fusion functions on the legs' SQL output.
The chosen fusion then also runs end to end through ``HybridRetriever.search``. ``--skip-queries``
confirms a choice on queries it was not tuned on, and each fusion's gain over the keyword leg comes
with a paired bootstrap interval.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from ragstream.chunking import MarkdownChunker
from ragstream.core.search import SearchFilters
from ragstream.embedding import create_embedder
from ragstream.embedding.base import Embedder, TextKind, Vectors
from ragstream.messages import ChunksEmbedded, DocumentHeader, pack_vectors
from ragstream.parsing import Parser
from ragstream.retrieval import HybridRetriever, RetrievalSettings, SearchRequest
from ragstream.retrieval.fusion import (
    ConvexFusion,
    DistributionFusion,
    Fusion,
    RrfFusion,
    VectorScores,
    convex_fusion,
    distribution_fusion,
    reciprocal_rank_fusion,
)
from ragstream.segmentation import query_terms
from ragstream.settings import EmbeddingSettings, Settings
from ragstream.stages.embed import embedding_text
from ragstream.stages.index import IndexService
from ragstream.storage.citations import CitationStore
from ragstream.storage.database import connect_pool
from ragstream.storage.documents import DocumentStore, document_id
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.postings import BM25_TERMS
from ragstream.storage.scope import Scope
from ragstream.storage.search import _BM25_HITS, Hit, SearchStore

__all__ = ["main"]

CONNECTION = "insuranceqa"
TOP = 10
LEG = 30
# Published plain-BM25 nDCG@10 on this data (docs/architecture.md, "Benchmarks and data").
REFERENCE_BM25 = {"en": 0.295, "zh": 0.210}
BM25_GRID_K1 = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5)
BM25_GRID_B = (0.3, 0.5, 0.6, 0.75, 0.9, 1.0)
BM25_GRID_BIGRAM_WEIGHT = (0.0, 0.25, 0.5, 0.75, 1.0)
# Without --tune the bench measures the shipped defaults.
DEFAULTS = Settings()
RRF_GRID_K = (1, 5, 10, 20, 30, 45, 60, 100, 200)
RRF_GRID_KEYWORD_WEIGHT = (0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0, 20.0)
VECTOR_LEG = "vector: HNSW (vector_leg)"
CONVEX_GRID_ALPHA = (0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
DBSF_GRID_KEYWORD_SHARE = tuple(round(share / 20, 2) for share in range(1, 20))


# --------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Query:
    qid: str
    text: str
    relevant: frozenset[str]


def load_data(
    lang: str, split: str, limit: int | None, queries: int | None, skip: int = 0
) -> tuple[dict[str, str], list[Query]]:
    """Answers to index (answer id → text) and the split's queries with their relevant answer ids.

    ``skip`` leaves out the first queries (those tuned on, to confirm the choice on the others).
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
    selected = selected[skip:]
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


async def answer_header(store: DocumentStore, key: str, content: bytes, title: str) -> DocumentHeader:
    """The header of one InsuranceQA answer, a document of its own."""
    return DocumentHeader(
        document_id=document_id(CONNECTION, key),
        connection_id=CONNECTION,
        external_id=key,
        version=await store.next_version(),
        content_hash=hashlib.sha256(content).hexdigest(),
        title=title,
        source=f"answers/{key}",
        media_type="text/plain",
    )


async def ingest(pool: asyncpg.Pool, embedder: Embedder, answers: dict[str, str], batch: int = 256) -> float:
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
            header = await answer_header(store, key, content, parsed.title)
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

    def __init__(self, embedder: Embedder) -> None:
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


async def timed_legs(queries: Sequence[Query], call: Any, answer_of: dict[str, str]) -> tuple[Run, list[list[Hit]]]:
    """Run ``call(index)`` for every query: the answer ranking (for the metrics) and the hits."""
    run, hit_lists = Run(), []
    for index in range(len(queries)):
        started = time.perf_counter()
        hits = await call(index)
        run.seconds.append(time.perf_counter() - started)
        hit_lists.append(hits)
        run.rankings.append(answers_of([hit.chunk_id for hit in hits], answer_of))
    return run, hit_lists


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

# The candidate rows of SearchStore's BM25 statement (the same SQL), grouped per field and lexeme:
# everything the score is computed from.
_BM25_FEATURES = (
    _BM25_HITS
    + """
    SELECT field, lexeme, array_agg(id ORDER BY id) AS ids, array_agg(tf ORDER BY id) AS tfs,
           array_agg(dl ORDER BY id) AS dls
    FROM hits GROUP BY field, lexeme
"""
)


@dataclass(frozen=True)
class Candidates:
    """One query's candidate rows as arrays: chunk ids (sorted) and, per (chunk, field, lexeme) row,
    the chunk's index, field, tf, field length and the lexeme's df."""

    ids: np.ndarray
    chunk: np.ndarray
    field: np.ndarray
    tf: np.ndarray
    dl: np.ndarray
    df: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[asyncpg.Record]) -> Candidates:
        if not rows:
            empty = np.zeros(0)
            return cls(np.zeros(0, dtype=str), empty.astype(int), empty.astype(int), empty, empty, empty)
        ids = np.concatenate([np.asarray(row["ids"]) for row in rows])
        unique, inverse = np.unique(ids, return_inverse=True)
        return cls(
            unique,
            inverse,
            np.concatenate([np.full(len(row["ids"]), row["field"]) for row in rows]),
            np.concatenate([np.asarray(row["tfs"], dtype=np.float64) for row in rows]),
            np.concatenate([np.asarray(row["dls"], dtype=np.float64) for row in rows]),
            np.concatenate([np.full(len(row["ids"]), float(len(row["ids"]))) for row in rows]),
        )

    def field_scores(self, n: float, averages: tuple[float, float], k1: float, b: float) -> list[np.ndarray]:
        """Per-chunk BM25 of the words (0) and of the bigrams (1), by the SQL's formula."""
        idf = np.log(1 + (np.maximum(n, self.df) - self.df + 0.5) / (self.df + 0.5))
        average = np.where(self.field == 0, averages[0], averages[1])
        contribution = idf * self.tf * (k1 + 1) / (self.tf + k1 * (1 - b + b * self.dl / average))
        return [
            np.bincount(self.chunk, weights=np.where(self.field == field, contribution, 0.0), minlength=len(self.ids))
            for field in (0, 1)
        ]

    def top(self, scores: np.ndarray, k: int) -> list[str]:
        """The k best ids, ties by id as in SQL (ids are sorted, so by index)."""
        if len(scores) > k:
            kth = np.partition(-scores, k - 1)[k - 1]
            keep = np.flatnonzero(-scores <= kth)
        else:
            keep = np.arange(len(scores))
        order = keep[np.lexsort((keep, -scores[keep]))][:k]
        return list(self.ids[order])


async def tune_bm25(
    pool: asyncpg.Pool, terms: Sequence[list[str]], queries: Sequence[Query], answer_of: dict[str, str]
) -> dict[tuple[float, float, float], dict[str, float]]:
    """nDCG@10 / Recall@10 of every (k1, b, bigram weight) in the grid, from one statement per query."""
    scope = Scope.build(SearchFilters(), None, first_param=3)
    stats = await pool.fetchrow(
        "SELECT count(*)::float8 AS n, avg(lexeme_count)::float8 AS words,"
        " avg(bigram_count) FILTER (WHERE bigram_count > 0)::float8 AS bigrams FROM chunks"
    )
    assert stats is not None
    averages = (stats["words"] or 1.0, stats["bigrams"] or 1.0)
    sql = _BM25_FEATURES.format(terms=BM25_TERMS.format(text=2), joins=scope.joins, scope=scope.sql)
    grid = list(itertools.product(BM25_GRID_K1, BM25_GRID_B, BM25_GRID_BIGRAM_WEIGHT))
    runs = {params: Run() for params in grid}
    for query, query_terms_ in zip(queries, terms, strict=True):
        rows = await pool.fetch(sql, query_terms_, query.text, *scope.params) if query_terms_ else []
        candidates = Candidates.from_rows(rows)
        for k1, b in itertools.product(BM25_GRID_K1, BM25_GRID_B):
            words, bigrams = candidates.field_scores(stats["n"], averages, k1, b)
            for weight in BM25_GRID_BIGRAM_WEIGHT:
                top = candidates.top(words + weight * bigrams, LEG)
                runs[(k1, b, weight)].rankings.append(answers_of(top, answer_of))
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


@dataclass(frozen=True)
class Choice:
    k1: float
    b: float
    bigram_weight: float
    rrf_k: int
    keyword_weight: float
    alpha: float
    fusion: Fusion

    def fusion_config(self) -> RrfFusion | ConvexFusion | DistributionFusion:
        if self.fusion == "rrf":
            return RrfFusion(k=self.rrf_k, vector_weight=1.0, keyword_weight=self.keyword_weight)
        if self.fusion == "dbsf":
            return DistributionFusion.keyword_share(self.alpha)
        return ConvexFusion(alpha=self.alpha)


class LanguageBench:
    """Every measurement of one language's index; the driver runs the languages side by side."""

    def __init__(self, lang: str, pool: asyncpg.Pool, embedder: Embedder, args: argparse.Namespace) -> None:
        self.lang, self.pool, self.args = lang, pool, args
        self.answers, self.queries = load_data(lang, args.split, args.limit, args.queries, args.skip_queries)
        self.embedder = embedder
        self.vectors = QueryVectors(embedder)
        self.terms = [query_terms(query.text) for query in self.queries]
        self.scope = Scope.build(SearchFilters(), None, first_param=3)
        self.report: dict[str, Any] = {"lang": lang, "answers": len(self.answers), "queries": len(self.queries)}
        self.runs: dict[str, Run] = {}
        self.answer_of: dict[str, str] = {}
        self.vector_lists: list[list[Hit]] = []
        self.keyword_lists: list[list[Hit]] = []
        self.similarities: list[dict[str, float]] = []  # of the keyword leg's chunks, for score fusion
        self.table = ""
        self.bm25_grid: dict[tuple[float, float, float], dict[str, float]] = {}
        self.rrf_grid: dict[tuple[int, float], dict[str, float]] = {}
        self.convex_grid: dict[float, dict[str, float]] = {}
        self.grid_rows: dict[str, dict[str, float]] = {}  # figures from the grids, not from a SQL run

    def say(self, name: str) -> None:
        print(f"  [{self.lang}] {name}: {self.runs[name].metrics(self.queries)}", file=sys.stderr, flush=True)

    async def ingest(self) -> None:
        print(f"[{self.lang}] {len(self.answers)} answers, {len(self.queries)} queries", file=sys.stderr)
        if seconds := await ingest(self.pool, self.embedder, self.answers):
            self.report["ingest_seconds"] = round(seconds, 1)

    async def legs(self) -> None:
        """The reference, both vector rankings and ts_rank_cd: what does not depend on the choice."""
        rows = await self.pool.fetch(
            "SELECT c.id, d.external_id FROM chunks c JOIN documents d ON d.id = c.document_id"
        )
        self.answer_of = {row["id"]: row["external_id"] for row in rows}
        self.report["chunks"] = len(self.answer_of)
        per_query = await self.vectors.prepare([query.text for query in self.queries])
        self.report["embed_query_ms"] = round(1000 * per_query, 1)
        queries, terms, scope = self.queries, self.terms, self.scope

        name = "keyword: plain BM25 reference (Python, k1=1.2 b=0.75)"
        self.runs[name] = plain_bm25(self.answers, queries, self.lang)
        self.say(name)

        store = SearchStore(self.pool, ef_search=self.args.ef_search)
        table = await store.embedding_table(self.embedder.model_key)
        assert table is not None
        self.table = table
        name = VECTOR_LEG
        self.runs[name], self.vector_lists = await timed_legs(
            queries, lambda i: store.vector_leg(table, self.vectors[queries[i].text], LEG, scope), self.answer_of
        )
        self.say(name)
        exact = await exact_neighbours(self.pool, table, np.stack([self.vectors[q.text] for q in queries]), LEG)
        self.runs["vector: exact kNN"] = Run([answers_of(ids, self.answer_of) for ids in exact])
        self.say("vector: exact kNN")
        self.report["hnsw_recall_vs_exact"] = {
            f"@{k}": round(
                statistics.fmean(
                    len({hit.chunk_id for hit in v[:k]} & set(e[:k])) / max(min(k, len(e)), 1)
                    for v, e in zip(self.vector_lists, exact, strict=True)
                ),
                4,
            )
            for k in (TOP, LEG)
        }
        if not self.args.skip_ts_rank:
            ts_rank = SearchStore(self.pool, keyword_ranking="ts_rank")
            name = "keyword: ts_rank_cd (words)"
            self.runs[name], _ = await timed_legs(
                queries, lambda i: ts_rank.keyword_leg(terms[i], LEG, scope), self.answer_of
            )
            self.say(name)

    async def tune_bm25(self) -> None:
        self.bm25_grid = await tune_bm25(self.pool, self.terms, self.queries, self.answer_of)
        best = max(self.bm25_grid, key=lambda p: (self.bm25_grid[p]["ndcg@10"], self.bm25_grid[p]["recall@10"]))
        self.report["bm25_grid"] = [
            {"k1": k1, "b": b, "bigram_weight": w, **m} for (k1, b, w), m in self.bm25_grid.items()
        ]
        self.report["bm25_best_for_this_language"] = dict(zip(("k1", "b", "bigram_weight"), best, strict=True))
        self.report["bm25_best_for_this_language"].update(self.bm25_grid[best])

    async def keyword(self, k1: float, b: float, bigram_weight: float) -> None:
        """The BM25 keyword leg through the real SQL, with the query text as the retriever passes it."""
        keyword = SearchStore(self.pool, bm25_k1=k1, bm25_b=b, bigram_weight=bigram_weight)
        name = f"keyword: BM25 words + bigrams (k1={k1} b={b} bigram weight {bigram_weight})"
        queries, terms, scope = self.queries, self.terms, self.scope
        self.runs[name], self.keyword_lists = await timed_legs(
            queries, lambda i: keyword.keyword_leg(terms[i], LEG, scope, query=queries[i].text), self.answer_of
        )
        self.say(name)
        self.keyword_name = name
        # Cosine of the keyword leg's chunks the vector leg missed: what the convex fusion adds.
        store = SearchStore(self.pool)
        for query, vector_hits, keyword_hits in zip(queries, self.vector_lists, self.keyword_lists, strict=True):
            found = {hit.chunk_id for hit in vector_hits}
            missing = [hit.chunk_id for hit in keyword_hits if hit.chunk_id not in found]
            self.similarities.append(await store.similarities(self.table, self.vectors[query.text], missing))
        if (k1, b, bigram_weight) in self.bm25_grid:  # the numpy scoring must agree with the SQL
            sql = self.runs[name].metrics(queries)
            self.report["bm25_grid_check"] = {"sql": sql, "numpy": self.bm25_grid[(k1, b, bigram_weight)]}
        words_only = self.bm25_grid.get((k1, b, 0.0))
        if words_only is not None and bigram_weight:
            self.grid_rows[f"keyword: BM25 words only (k1={k1} b={b}; numpy on the same SQL rows)"] = words_only

    def rrf_run(self, k: int, keyword_weight: float) -> Run:
        """RRF of the two legs' outputs, by the function the retriever calls."""
        run = Run()
        for v, kw in zip(self.vector_lists, self.keyword_lists, strict=True):
            rankings = [[hit.chunk_id for hit in v], [hit.chunk_id for hit in kw]]
            fused = reciprocal_rank_fusion(rankings, weights=[1.0, keyword_weight], k=k)
            run.rankings.append(answers_of([chunk for chunk, _ in fused[:TOP]], self.answer_of))
        return run

    def convex_run(self, alpha: float) -> Run:
        """The convex fusion of the two legs' outputs, by the function the retriever calls."""
        run = Run()
        for v, kw, similarity in zip(self.vector_lists, self.keyword_lists, self.similarities, strict=True):
            fused = convex_fusion([VectorScores(1.0, v, similarity)], kw, alpha=alpha)
            run.rankings.append(answers_of([chunk for chunk, _ in fused[:TOP]], self.answer_of))
        return run

    def dbsf_run(self, keyword_share: float) -> Run:
        """The distribution-based score fusion of the two legs' outputs, by the function the retriever calls."""
        run = Run()
        for v, kw, similarity in zip(self.vector_lists, self.keyword_lists, self.similarities, strict=True):
            vector = VectorScores(1 - keyword_share, v, similarity)
            fused = distribution_fusion([vector], kw, keyword_weight=keyword_share)
            run.rankings.append(answers_of([chunk for chunk, _ in fused[:TOP]], self.answer_of))
        return run

    def tune_fusion(self) -> None:
        for k, weight in itertools.product(RRF_GRID_K, RRF_GRID_KEYWORD_WEIGHT):
            self.rrf_grid[(k, weight)] = self.rrf_run(k, weight).metrics(self.queries)
        self.report["rrf_grid"] = [{"k": k, "keyword_weight": w, **m} for (k, w), m in self.rrf_grid.items()]
        best = max(self.rrf_grid, key=lambda p: (self.rrf_grid[p]["ndcg@10"], self.rrf_grid[p]["recall@10"]))
        self.report["rrf_best_for_this_language"] = {"k": best[0], "keyword_weight": best[1], **self.rrf_grid[best]}
        self.convex_grid = {alpha: self.convex_run(alpha).metrics(self.queries) for alpha in CONVEX_GRID_ALPHA}
        self.report["convex_grid"] = [{"alpha": alpha, **m} for alpha, m in self.convex_grid.items()]
        best_alpha = max(
            self.convex_grid, key=lambda a: (self.convex_grid[a]["ndcg@10"], self.convex_grid[a]["recall@10"])
        )
        self.report["convex_best_for_this_language"] = {"alpha": best_alpha, **self.convex_grid[best_alpha]}
        dbsf_grid = {share: self.dbsf_run(share).metrics(self.queries) for share in DBSF_GRID_KEYWORD_SHARE}
        self.report["dbsf_grid"] = [{"keyword_share": share, **m} for share, m in dbsf_grid.items()]
        best_share = max(dbsf_grid, key=lambda s: (dbsf_grid[s]["ndcg@10"], dbsf_grid[s]["recall@10"]))
        self.report["dbsf_best_for_this_language"] = {"keyword_share": best_share, **dbsf_grid[best_share]}
        first = self.args.skip_queries + 1
        tuned_on = f"InsuranceQA {self.args.split} queries {first}-{first + len(self.queries) - 1}, {self.lang}"
        candidates: list[tuple[dict[str, float], RrfFusion | ConvexFusion | DistributionFusion]] = [
            (self.rrf_grid[best], RrfFusion(k=best[0], keyword_weight=best[1], tuned_on=tuned_on)),
            (self.convex_grid[best_alpha], ConvexFusion(alpha=best_alpha, tuned_on=tuned_on)),
            (
                dbsf_grid[best_share],
                DistributionFusion.keyword_share(best_share, tuned_on=tuned_on),
            ),
        ]
        metrics, fusion = max(candidates, key=lambda pair: (pair[0]["ndcg@10"], pair[0]["recall@10"]))
        # What `PUT /v1/spaces/{model_key}/fusion` takes: this model's own weights, in any deployment.
        self.report["space_fusion"] = {
            "model_key": self.embedder.model_key,
            "fusion": fusion.model_dump(),
            "ndcg@10": metrics["ndcg@10"],
        }

    async def fused(self, choice: Choice) -> None:
        """Each fusion from the legs' outputs (the same SQL rows, no second pass), then the chosen
        one end to end through ``HybridRetriever.search``, which must agree with it."""
        runs = {
            "RRF k=60, weights 1/1 (untuned)": self.rrf_run(60, 1.0),
            f"RRF k={choice.rrf_k}, weights 1/{choice.keyword_weight} (vector/keyword)": self.rrf_run(
                choice.rrf_k, choice.keyword_weight
            ),
            f"convex, alpha {choice.alpha} (keyword share)": self.convex_run(choice.alpha),
            f"distribution-based, keyword share {choice.alpha}": self.dbsf_run(choice.alpha),
        }
        for label, run in runs.items():
            self.runs[f"fused: {label}"] = run
            self.say(f"fused: {label}")
            self.report.setdefault("vs_keyword_leg", {})[label] = paired_difference(
                run, self.runs[self.keyword_name], self.queries
            )
            # A strong embedder's vector leg can beat the keyword leg: fusion has to beat it too.
            self.report.setdefault("vs_vector_leg", {})[label] = paired_difference(
                run, self.runs[VECTOR_LEG], self.queries
            )
        store = SearchStore(
            self.pool,
            ef_search=self.args.ef_search,
            bm25_k1=choice.k1,
            bm25_b=choice.b,
            bigram_weight=choice.bigram_weight,
        )
        retriever = HybridRetriever(
            store,
            self.vectors,
            CitationStore(self.pool),
            settings=RetrievalSettings(leg_size=LEG, fusion=choice.fusion_config()),
        )

        async def search(i: int) -> list[Hit]:
            response = await retriever.search(SearchRequest(query=self.queries[i].text, top_k=TOP))
            return [Hit(result.chunk_id, result.score) for result in response.results]

        name = f"fused end to end: HybridRetriever.search, fusion={choice.fusion}"
        self.runs[name], _ = await timed_legs(self.queries, search, self.answer_of)
        self.say(name)

    def finish(self, choice: Choice) -> dict[str, Any]:
        self.report["settings"] = {
            **asdict(choice),
            "vector_weight": 1.0,
            "leg_size": LEG,
            "ef_search": self.args.ef_search,
        }
        self.report["runs"] = {name: run.metrics(self.queries) for name, run in self.runs.items()}
        self.report["runs"].update(self.grid_rows)
        return self.report


def paired_difference(run: Run, baseline: Run, queries: Sequence[Query], resamples: int = 2000) -> dict[str, float]:
    """Mean per-query nDCG@10 gain of ``run`` over ``baseline`` with a 95% bootstrap interval, and
    how many queries got better or worse: whether a gain is more than the luck of the queries."""
    gains = np.array(
        [
            score(ours, query.relevant)[0] - score(theirs, query.relevant)[0]
            for ours, theirs, query in zip(run.rankings, baseline.rankings, queries, strict=True)
        ]
    )
    means = np.random.default_rng(0).choice(gains, size=(resamples, len(gains))).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {
        "ndcg@10_gain": round(float(gains.mean()), 4),
        "ci95_low": round(float(low), 4),
        "ci95_high": round(float(high), 4),
        "better": int((gains > 0).sum()),
        "worse": int((gains < 0).sum()),
    }


def joint_best(grids: Sequence[dict[Any, dict[str, float]]]) -> Any:
    """The grid point with the best mean nDCG@10 (then Recall@10) over the languages."""
    return max(
        grids[0],
        key=lambda point: (
            statistics.fmean(grid[point]["ndcg@10"] for grid in grids),
            statistics.fmean(grid[point]["recall@10"] for grid in grids),
        ),
    )


async def measure(benches: Sequence[LanguageBench], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure the languages side by side; with ``--tune``, choose one setting for all of them."""
    await asyncio.gather(*(bench.legs() for bench in benches))
    choice = Choice(args.k1, args.b, args.bigram_weight, args.rrf_k, args.keyword_weight, args.alpha, args.fusion)
    tune = set(args.tune or ("bm25", "fusion")) if args.tune is not None else set()
    if "bm25" in tune:
        await asyncio.gather(*(bench.tune_bm25() for bench in benches))
        k1, b, bigram_weight = joint_best([bench.bm25_grid for bench in benches])
        choice = replace(choice, k1=k1, b=b, bigram_weight=bigram_weight)
        print(f"  BM25 chosen: k1={k1} b={b} bigram weight {bigram_weight}", file=sys.stderr, flush=True)
    await asyncio.gather(*(bench.keyword(choice.k1, choice.b, choice.bigram_weight) for bench in benches))
    if "fusion" in tune:
        for bench in benches:
            bench.tune_fusion()
        rrf_k, keyword_weight = joint_best([bench.rrf_grid for bench in benches])
        alpha = joint_best([bench.convex_grid for bench in benches])
        choice = replace(choice, rrf_k=rrf_k, keyword_weight=keyword_weight, alpha=alpha)
        print(f"  RRF chosen: k={rrf_k} keyword weight {keyword_weight}; convex alpha {alpha}", file=sys.stderr)
    await asyncio.gather(*(bench.fused(choice) for bench in benches))
    return [bench.finish(choice) for bench in benches]


def write_results(reports: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for report in reports:
        print(
            f"\n{report['lang']}: {report['answers']} answers ({report['chunks']} chunks), {report['queries']}"
            f" {args.split} queries; HNSW recall vs exact kNN {report['hnsw_recall_vs_exact']}"
        )
        print(f"  {'run':86} {'nDCG@10':>8} {'R@10':>7} {'p50 ms':>7} {'p95 ms':>7}")
        for name, m in report["runs"].items():
            print(
                f"  {name:86} {m['ndcg@10']:8.4f} {m['recall@10']:7.4f}"
                f" {m.get('p50_ms', float('nan')):7.1f} {m.get('p95_ms', float('nan')):7.1f}"
            )
        print(f"  plain BM25, published (test split): nDCG@10 {REFERENCE_BM25[report['lang']]}")
        if space := report.get("space_fusion"):
            print(
                f"  this model's fusion (nDCG@10 {space['ndcg@10']:.4f}): PUT /v1/spaces/{space['model_key']}/fusion"
                f" {json.dumps(space['fusion'], ensure_ascii=False)}"
            )
        for key in (
            "settings",
            "vs_keyword_leg",
            "bm25_best_for_this_language",
            "rrf_best_for_this_language",
            "convex_best_for_this_language",
            "bm25_grid_check",
        ):
            if key in report:
                print(f"  {key}: {report[key]}")
    suffix = f"-limit{args.limit}" if args.limit else ""
    suffix += f"-from{args.skip_queries}" if args.skip_queries else ""
    suffix += f"-q{args.queries}" if args.queries else ""
    out = args.out or Path(__file__).parent / "results" / f"quality-{args.split}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": " ".join(["bench/quality.py", *sys.argv[1:]]),
        "reference_plain_bm25_ndcg@10_test": REFERENCE_BM25,
    }
    results.update({report["lang"]: report for report in reports})
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwritten {out}")


async def database(base_dsn: str, name: str) -> str:
    """The DSN of database ``name`` on the server of ``base_dsn``, created if missing."""
    connection = await asyncpg.connect(base_dsn)
    try:
        if not await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    return base_dsn.rsplit("/", 1)[0] + f"/{name}"


async def run(base_dsn: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    pools, benches = [], []
    settings = EmbeddingSettings(provider=args.provider, model=args.model, threads=args.threads)
    embedder = create_embedder(settings)
    # The USE databases keep their first names; another model gets a database (and an index) of its own.
    model = "" if args.provider == "local" else "_" + re.sub(r"[^a-z0-9]+", "_", embedder.model_key.lower())
    try:
        for lang in args.lang:
            name = f"quality_{lang}" + (f"_{args.limit}" if args.limit else "") + model
            pools.append(await connect_pool(await database(base_dsn, name), max_size=4))
            benches.append(LanguageBench(lang, pools[-1], embedder, args))
            await benches[-1].ingest()
        if args.ingest_only:
            return [bench.report for bench in benches]
        return await measure(benches, args)
    finally:
        await embedder.aclose()
        for pool in pools:
            await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lang", nargs="+", choices=("en", "zh"), default=["en", "zh"])
    parser.add_argument("--split", choices=("valid", "test"), default="valid", help="test is reserved for releases")
    parser.add_argument("--limit", type=int, help="index only about this many answers (quick iterations)")
    parser.add_argument("--queries", type=int, help="only the first N queries of the split (after --skip-queries)")
    parser.add_argument("--skip-queries", type=int, default=0, help="leave out the first N (e.g. those tuned on)")
    parser.add_argument(
        "--tune",
        nargs="*",
        choices=("bm25", "fusion"),
        help="search the BM25 (k1, b, bigram weight) and/or fusion (RRF k and weight, convex alpha) grids; bare: both",
    )
    parser.add_argument("--ingest-only", action="store_true")
    parser.add_argument("--skip-ts-rank", action="store_true", help="do not measure the ts_rank_cd ranking")
    parser.add_argument("--threads", type=int, default=2, help="embedder threads")
    parser.add_argument("--provider", choices=("local", "onnx"), default="local", help="local: USE; onnx: BGE")
    parser.add_argument("--model", help="of the onnx provider: bge-small-zh-v1.5 (default) or bge-small-en-v1.5")
    parser.add_argument("--k1", type=float, default=DEFAULTS.bm25_k1, help="BM25 k1 of the keyword leg")
    parser.add_argument("--b", type=float, default=DEFAULTS.bm25_b, help="BM25 b of the keyword leg")
    parser.add_argument("--bigram-weight", type=float, default=DEFAULTS.bm25_bigram_weight, help="BM25 bigram weight")
    parser.add_argument("--rrf-k", type=int, default=DEFAULTS.rrf_k)
    parser.add_argument("--keyword-weight", type=float, default=DEFAULTS.rrf_keyword_weight, help="vector weight is 1")
    parser.add_argument(
        "--fusion", choices=("rrf", "convex", "dbsf"), default=DEFAULTS.fusion, help="of the end-to-end run"
    )
    parser.add_argument(
        "--alpha", type=float, default=DEFAULTS.fusion_alpha, help="keyword share of convex or dbsf fusion"
    )
    parser.add_argument("--ef-search", type=int, default=100, help="hnsw.ef_search of the vector leg")
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "ragstream-quality")
    parser.add_argument("--out", type=Path, help="JSON results (default bench/results/quality-<split>.json)")
    args = parser.parse_args()

    if dsn := os.environ.get("DATABASE_URL"):
        reports = asyncio.run(run(dsn, args))
    else:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        with EmbeddedPostgres(args.data_dir) as server:
            reports = asyncio.run(run(server.dsn, args))
    if not args.ingest_only:
        write_results(reports, args)


if __name__ == "__main__":
    main()
