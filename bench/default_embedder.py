"""Which embedder and fusion a new deployment should get: every candidate default measured on InsuranceQA
``valid``, tuned on queries 1-500 and checked on 501-1,000, in English and in Chinese.

    .venv/bin/pip install insuranceqa-data==1.2
    .venv/bin/python -m bench.default_embedder [--lang en zh] [--data-dir DIR] [--out FILE]

The answers are chunked and committed as ``bench/keyword_exactness.py`` does (one database per language,
placeholder vectors), and the keyword leg (``SearchStore.keyword_leg``, the shipped BM25, top 30) runs
for the first 1,000 ``valid`` queries. Every committed chunk's embedding input (``embedding_input``: the
title, heading path and text, as ingest embeds it) is then embedded by each candidate model, and the
queries too (``kind="query"``): the local USE multilingual v3 and the offline BGE small models of the
language, v1.5 and v1 (``bge-small-zh-v1.5`` and ``bge-small-zh``, or the ``-en`` ones: what the
language-routed default space gives a corpus in one language). Vectors are cached in ``--data-dir``, so a
second run only scores. Each vector leg is the exact top 30 by cosine (HNSW finds 97-99 % of it at
``ef_search`` 100, docs/retrieval-quality.md).

Scored per answer (nDCG@10 and Recall@10, a query's relevant answers from the judgments) for each leg,
each fusion of the keyword leg with one vector leg, with a BGE leg and USE, with both BGE legs and with
all of them: RRF over a grid of k and weights, convex combinations of the legs' scores (BM25 over its
best, cosines as they are) and distribution-based fusion, every grid point on queries 1-500; the best
point per fusion family, chosen there, is reported on queries 501-1,000 with its paired bootstrap
difference against each of its legs, and so is the default space's measured fusion as the retriever
applies it. Also printed: embedding throughput per model on this machine (texts/s and characters/s of
the whole pass) and the load.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from bench.keyword_exactness import ingest as commit_keyword_corpus
from bench.quality import Query, Run, answers_of, database, load_data, paired_difference, score
from ragstream.core.search import SearchFilters
from ragstream.core.vectors import BILINGUAL_PAIR_MODEL_KEY, vector_blocks
from ragstream.embedding.base import Embedder
from ragstream.embedding.bilingual import BGE_MODELS, is_chinese
from ragstream.embedding.local import LocalUSEEmbedder
from ragstream.embedding.onnx import OnnxEmbedder
from ragstream.retrieval.fusion import (
    MEASURED_FUSION,
    DistributionFusion,
    RrfFusion,
    VectorScores,
    distribution_fusion,
    reciprocal_rank_fusion,
)
from ragstream.segmentation import query_terms
from ragstream.settings import Settings
from ragstream.stages.embed import embedding_input
from ragstream.storage.database import connect_pool
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.scope import Scope
from ragstream.storage.search import Hit, SearchStore

__all__ = ["main"]

LEG = 30
TUNE = 500
QUERIES = 1000
RRF_K = (1, 5, 10, 20, 30, 60, 100)
RRF_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)  # of each vector leg; keyword 1
CONVEX_WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DBSF_SHARES = tuple(round(share / 20, 2) for share in range(21))  # each leg's share, in twentieths
CANDIDATES = {"en": ["bge-small-en-v1.5", "bge-small-en", "use"], "zh": ["bge-small-zh-v1.5", "bge-small-zh", "use"]}
"""The models measured per language unless ``--models`` names others (e.g. ``bge-small-zh-v1.5-fp32``);
"use" is the local USE, the others BGE (onnx): v1.5 and v1 of the language (the default space embeds Chinese
texts with both, English ones with v1.5 only)."""
PLAIN = " (query without instruction)"


@dataclass(frozen=True)
class Legs:
    """Per query: the keyword leg's (chunk, BM25) best first, and per model the cosine of every chunk."""

    chunk_ids: list[str]
    keyword: list[list[tuple[str, float]]]
    cosines: dict[str, np.ndarray]  # model → (queries, chunks)
    vector: dict[str, list[list[tuple[str, float]]]]  # model → per query its exact top LEG

    @classmethod
    def build(
        cls, chunk_ids: list[str], keyword: list[list[tuple[str, float]]], cosines: dict[str, np.ndarray]
    ) -> Legs:
        vector = {}
        for model, matrix in cosines.items():
            top = np.argpartition(-matrix, LEG, axis=1)[:, :LEG]
            rows = []
            for query, candidates in enumerate(top):
                ordered = candidates[np.argsort(-matrix[query, candidates], kind="stable")]
                rows.append([(chunk_ids[index], float(matrix[query, index])) for index in ordered])
            vector[model] = rows
        return cls(chunk_ids, keyword, cosines, vector)

    def vector_leg(self, model: str, query: int) -> list[tuple[str, float]]:
        return self.vector[model][query]

    @functools.cached_property
    def position(self) -> dict[str, int]:
        """Each chunk's column in ``cosines``."""
        return {chunk: index for index, chunk in enumerate(self.chunk_ids)}


def candidates(name: str, legs: Legs, models: Sequence[str]) -> Callable[..., list[str]]:
    """A fusion family's ranking of one query for one grid point, as chunk ids best first."""

    def rrf(query: int, *, point: tuple[float, ...]) -> list[str]:
        k, keyword_weight, *vector_weights = point
        rankings = [[chunk for chunk, _ in legs.keyword[query]]]
        rankings += [[chunk for chunk, _ in legs.vector_leg(model, query)] for model in models]
        fused = reciprocal_rank_fusion(rankings, weights=[keyword_weight, *vector_weights], k=int(k))
        return [chunk for chunk, _ in fused]

    def convex(query: int, *, point: tuple[float, ...]) -> list[str]:
        keyword_weight, *vector_weights = point
        keyword = legs.keyword[query]
        best = max((value for _, value in keyword), default=0.0)
        pool = dict.fromkeys(
            [chunk for chunk, _ in keyword] + [chunk for m in models for chunk, _ in legs.vector_leg(m, query)]
        )
        lexical = {chunk: value / best for chunk, value in keyword} if best > 0 else {}
        scores = {
            chunk: keyword_weight * lexical.get(chunk, 0.0)
            + sum(
                weight * float(legs.cosines[model][query, legs.position[chunk]])
                for model, weight in zip(models, vector_weights, strict=True)
            )
            for chunk in pool
        }
        return [chunk for chunk, _ in sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))]

    def dbsf(query: int, *, point: tuple[float, ...]) -> list[str]:
        keyword_weight, *vector_weights = point
        return [chunk for chunk, _ in fuse_distributions(legs, query, models, keyword_weight, vector_weights, [])]

    return {"rrf": rrf, "convex": convex, "dbsf": dbsf}[name]


def fuse_distributions(
    legs: Legs,
    query: int,
    models: Sequence[str],
    keyword_weight: float,
    vector_weights: Sequence[float],
    item_weights: list[dict[str, float]],
) -> list[tuple[str, float]]:
    """``distribution_fusion`` as the retriever calls it: each vector leg's hits, and the cosine of the
    keyword-only chunks it did not return (the retriever's read-back)."""
    keyword = [Hit(chunk, value) for chunk, value in legs.keyword[query]]
    vectors = []
    for model, weight in zip(models, vector_weights, strict=True):
        hits = [Hit(chunk, value) for chunk, value in legs.vector_leg(model, query)]
        found = {hit.chunk_id for hit in hits}
        missing = [hit.chunk_id for hit in keyword if hit.chunk_id not in found]
        similarity = {chunk: float(legs.cosines[model][query, legs.position[chunk]]) for chunk in missing}
        vectors.append(VectorScores(weight, hits, similarity))
    return distribution_fusion(
        vectors, keyword, keyword_weight=keyword_weight, item_weights=item_weights or [{} for _ in vectors]
    )


def grid(name: str, vector_legs: int) -> list[tuple[float, ...]]:
    """RRF: (k, keyword weight 1, vector weights); convex and dbsf: (keyword share, vector shares),
    summing to 1 (convex in tenths, dbsf in twentieths)."""
    if name == "rrf":
        weights = [w for w in itertools.product(RRF_WEIGHTS, repeat=vector_legs) if any(w)]
        return [(k, 1.0, *w) for k in RRF_K for w in weights]
    points = []
    for weights in itertools.product(CONVEX_WEIGHTS if name == "convex" else DBSF_SHARES, repeat=vector_legs):
        keyword = round(1 - sum(weights), 2)
        if keyword > 0 and any(weights):
            points.append((keyword, *weights))
    return points


def evaluate(
    rank: Callable[[int], list[str]], queries: Sequence[Query], answer_of: dict[str, str], offset: int
) -> dict[str, Any]:
    rankings = [answers_of(rank(offset + index), answer_of) for index in range(len(queries))]
    per_query = [score(ranking, query.relevant) for ranking, query in zip(rankings, queries, strict=True)]
    return {
        "ndcg10": float(np.mean([ndcg for ndcg, _ in per_query])),
        "recall10": float(np.mean([recall for _, recall in per_query])),
        "run": Run(rankings=rankings),
    }


#: The keyword leg as a deployment runs it: the settings' BM25 parameters, not ``SearchStore``'s own defaults.
SETTINGS = Settings()
BM25 = {"bm25_k1": SETTINGS.bm25_k1, "bm25_b": SETTINGS.bm25_b, "bigram_weight": SETTINGS.bm25_bigram_weight}


async def keyword_legs(pool: asyncpg.Pool, queries: Sequence[Query]) -> list[list[tuple[str, float]]]:
    store = SearchStore(pool, **BM25)
    scope = Scope.build(SearchFilters(), None, first_param=3)
    legs = []
    for query in queries:
        async with store.snapshot() as snapshot:
            hits = await snapshot.keyword_leg(query_terms(query.text), LEG, scope, query=query.text)
        legs.append([(hit.chunk_id, hit.score) for hit in hits])
    return legs


async def embed_all(embedder: Embedder, texts: list[str], kind: str, batch: int = 256) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    parts = []
    for start in range(0, len(texts), batch):
        parts.append(await embedder.embed(texts[start : start + batch], kind))  # type: ignore[arg-type]
        if kind == "document" and (start // batch) % 20 == 0:
            rate = (start + batch) / (time.perf_counter() - started)
            print(f"    {start + batch}/{len(texts)} ({rate:.0f}/s)", file=sys.stderr, flush=True)
    return np.vstack(parts).astype(np.float32), time.perf_counter() - started


def embedder_for(model: str, folder: Path) -> Embedder:
    return LocalUSEEmbedder() if model == "use" else OnnxEmbedder(model, folder)


async def language(lang: str, base_dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    answers, queries = load_data(lang, "valid", None, QUERIES)
    pool = await connect_pool(await database(base_dsn, f"default_embedder_{lang}"), max_size=6)
    try:
        seconds, answer_of = await commit_keyword_corpus(pool, answers)
        print(f"{lang}: {len(answer_of)} chunks committed ({seconds:.0f} s)", file=sys.stderr, flush=True)
        rows = await pool.fetch(
            "SELECT c.id, d.title, c.heading, c.text FROM chunks c"
            " JOIN documents d ON d.id = c.document_id ORDER BY c.id"
        )
        keyword_cache = args.data_dir / f"keyword-{lang}-{'-'.join(map(str, BM25.values()))}.json"
        if keyword_cache.exists():
            keyword = json.loads(keyword_cache.read_text())
        else:
            keyword = await keyword_legs(pool, queries)
            keyword_cache.write_text(json.dumps(keyword))
    finally:
        await pool.close()
    chunk_ids = [row["id"] for row in rows]
    texts = [embedding_input(row["title"], row["heading"], row["text"]) for row in rows]
    cosines, throughput = {}, {}
    for model in args.models or CANDIDATES[lang]:
        cache = args.data_dir / f"vectors-{lang}-{model}.npz"
        if cache.exists():
            stored = np.load(cache)
            documents, question_vectors = stored["documents"], stored["queries"]
            throughput[model] = json.loads(str(stored["throughput"]))
        else:
            embedder = embedder_for(model, args.data_dir / "models")
            await embedder.warm_up()
            load = os.getloadavg()[0]
            print(f"  {lang}: embedding {len(texts)} chunks with {model}", file=sys.stderr, flush=True)
            documents, took = await embed_all(embedder, texts, "document")
            question_vectors, _ = await embed_all(embedder, [query.text for query in queries], "query")
            throughput[model] = {
                "texts_per_s": len(texts) / took,
                "chars_per_s": sum(map(len, texts)) / took,
                "seconds": took,
                "load_before": load,
                "load_after": os.getloadavg()[0],
            }
            np.savez(cache, documents=documents, queries=question_vectors, throughput=json.dumps(throughput[model]))
            await embedder.aclose()
        cosines[model] = question_vectors @ documents.T
        if model != "use":  # BGE v1.5 asks for its instruction before queries; does it help here?
            plain_cache = args.data_dir / f"queries-plain-{lang}-{model}.npy"
            if not plain_cache.exists():
                embedder = embedder_for(model, args.data_dir / "models")
                np.save(plain_cache, (await embed_all(embedder, [query.text for query in queries], "document"))[0])
                await embedder.aclose()
            cosines[model + PLAIN] = np.load(plain_cache) @ documents.T
    legs = Legs.build(chunk_ids, keyword, cosines)
    chinese = {row["id"]: is_chinese(row["text"]) for row in rows}
    return score_language(lang, legs, queries, answer_of, throughput, chinese)


def shipped_default(
    lang: str, legs: Legs, queries: Sequence[Query], answer_of: dict[str, str], chinese: dict[str, bool]
) -> dict[str, Any]:
    """The default space's measured fusion exactly as the retriever applies it: the fusion of the query's
    language over the keyword leg and every block's leg (the block's BGE model of ``lang``, USE), the USE
    leg's hits in the other language than the query's at their own weight."""
    shipped = MEASURED_FUSION[BILINGUAL_PAIR_MODEL_KEY]
    side = 0 if lang == "zh" else 1
    pairs = BGE_MODELS[BILINGUAL_PAIR_MODEL_KEY]
    *bge_blocks, use_block = vector_blocks(BILINGUAL_PAIR_MODEL_KEY)
    # A block without a model for the language repeats the first block's vector.
    models = {block.name: pair[side] or pairs[0][side] for block, pair in zip(bge_blocks, pairs, strict=True)}
    models[use_block.name] = "use"

    def rank(query: int) -> list[str]:
        fusion = shipped.for_query(queries[query].text)
        assert isinstance(fusion, RrfFusion | DistributionFusion)
        asked_in_chinese = is_chinese(queries[query].text)
        rankings = {name: legs.vector_leg(model, query) for name, model in models.items()}
        across = [
            {chunk: fusion.cross_language_weights[name] for chunk, _ in hits if chinese[chunk] != asked_in_chinese}
            if name in fusion.cross_language_weights
            else {}
            for name, hits in rankings.items()
        ]
        weights = [fusion.weight_of(name) for name in rankings]
        if isinstance(fusion, DistributionFusion):
            fused = fuse_distributions(legs, query, list(models.values()), fusion.keyword_weight, weights, across)
        else:
            fused = reciprocal_rank_fusion(
                [[chunk for chunk, _ in hits] for hits in rankings.values()]
                + [[chunk for chunk, _ in legs.keyword[query]]],
                weights=[*weights, fusion.keyword_weight],
                k=fusion.k,
                item_weights=[*across, {}],
            )
        return [chunk for chunk, _ in fused]

    tuned, held = list(queries[:TUNE]), list(queries[TUNE:])
    row = {"run": f"shipped default: {shipped.model_dump_json(exclude={'tuned_on'})}"}
    row["tuned"] = evaluate(rank, tuned, answer_of, 0)
    row["held_out"] = evaluate(rank, held, answer_of, TUNE)
    print(
        f"  {lang} {row['run']}: tuned {row['tuned']['ndcg10']:.4f} held out {row['held_out']['ndcg10']:.4f}",
        file=sys.stderr,
    )
    return row


def score_language(
    lang: str,
    legs: Legs,
    queries: Sequence[Query],
    answer_of: dict[str, str],
    throughput: dict[str, Any],
    chinese: dict[str, bool],
) -> dict[str, Any]:
    """Every leg, the best point of every fusion family, and the shipped default; ``chinese``: whether
    each chunk's text is Chinese, by the bilingual embedder's rule."""
    tuned, held = list(queries[:TUNE]), list(queries[TUNE:])
    report: dict[str, Any] = {"lang": lang, "chunks": len(legs.chunk_ids), "throughput": throughput, "rows": []}
    baselines: dict[str | None, dict[str, Any]] = {}

    def leg_rank(model: str | None) -> Callable[[int], list[str]]:
        if model is None:
            return lambda query: [chunk for chunk, _ in legs.keyword[query]]
        return lambda query: [chunk for chunk, _ in legs.vector_leg(model, query)]

    models = list(legs.cosines)
    for model in [None, *models]:
        row = {"run": f"vector leg, {model}" if model else "keyword leg (BM25)"}
        row["tuned"] = evaluate(leg_rank(model), tuned, answer_of, 0)
        row["held_out"] = baselines[model] = evaluate(leg_rank(model), held, answer_of, TUNE)
        report["rows"].append(row)
    families = [[model] for model in models] + [
        [model, "use"] for model in models if model != "use" and "use" in models
    ]
    bge = [model for model in models if model != "use" and not model.endswith(PLAIN)]
    if len(bge) > 1:  # the default space's blocks: both BGE generations, then with USE
        families += [bge] + ([[*bge, "use"]] if "use" in models else [])
    for family in families:
        for name in ("rrf", "convex", "dbsf"):
            rank = candidates(name, legs, family)
            best_point, best, best_result = None, -1.0, {}
            scored: dict[str, float] = {}
            for point in grid(name, len(family)):
                result = evaluate(functools.partial(rank, point=point), tuned, answer_of, 0)
                scored[json.dumps(point)] = round(result["ndcg10"], 4)
                if result["ndcg10"] > best:
                    best_point, best, best_result = point, result["ndcg10"], result
            assert best_point is not None
            held_result = evaluate(functools.partial(rank, point=best_point), held, answer_of, TUNE)
            row = {
                "run": f"keyword + {' + '.join(family)}, {name} {best_point}",
                "point": best_point,
                "family": family,
                "kind": name,
                "tuned": best_result,
                "held_out": held_result,
                "grid_tuned_ndcg10": scored,
                "vs_legs": {
                    f"vector leg, {leg}" if leg else "keyword leg": paired_difference(
                        held_result["run"], baselines[leg]["run"], held
                    )
                    for leg in [None, *family]
                },
            }
            report["rows"].append(row)
            print(
                f"  {lang} {row['run']}: tuned {best:.4f} held out {held_result['ndcg10']:.4f}",
                file=sys.stderr,
                flush=True,
            )
    shipped = shipped_default(lang, legs, queries, answer_of, chinese)
    shipped["vs_legs"] = {
        f"vector leg, {leg}" if leg else "keyword leg": paired_difference(
            shipped["held_out"]["run"], baselines[leg]["run"], held
        )
        for leg in (None, *bge, "use")
        if leg in baselines
    }
    report["rows"].append(shipped)
    return report


def space_fusion(row: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The default space and its fusion for a row of all its legs (keyword + BGE v1.5 + BGE v1 + USE), as
    ``PUT /v1/spaces/{model_key}/fusion`` takes it: the row's models in the order of the space's blocks."""
    point, family = row.get("point"), row.get("family")
    blocks = [block.name for block in vector_blocks(BILINGUAL_PAIR_MODEL_KEY)]
    if point is None or family is None or len(family) != len(blocks) or family[-1] != "use":
        return None
    if row["kind"] == "rrf":
        k, keyword, *weights = point
        fusion = {
            "kind": "rrf",
            "k": int(k),
            "keyword_weight": keyword,
            "block_weights": dict(zip(blocks, weights, strict=True)),
        }
    else:
        keyword, *weights = point
        share = {"keyword_weight": keyword} if row["kind"] == "dbsf" else {"alpha": keyword}
        fusion = {"kind": row["kind"], **share, "block_weights": dict(zip(blocks, weights, strict=True))}
    return BILINGUAL_PAIR_MODEL_KEY, fusion


def print_table(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        print(f"\n## {report['lang']}: {report['chunks']} chunks; load {os.getloadavg()[0]:.1f}")
        for model, figures in report["throughput"].items():
            print(
                f"  {model}: {figures['texts_per_s']:.1f} texts/s, {figures['chars_per_s']:.0f} chars/s"
                f" (load {figures['load_before']:.1f})"
            )
        print(
            "| run | nDCG@10 1-500 | R@10 1-500 | nDCG@10 501-1,000 | R@10 501-1,000 |"
            " held out vs each leg (mean [95% CI]) |"
        )
        print("|---|---|---|---|---|---|")
        for row in report["rows"]:
            if (put := space_fusion(row)) is not None:
                print(f"  PUT /v1/spaces/{put[0]}/fusion {json.dumps(put[1])}")
        for row in report["rows"]:
            versus = "; ".join(
                f"{label}: {d['ndcg@10_gain']:+.4f} [{d['ci95_low']:+.3f}, {d['ci95_high']:+.3f}]"
                for label, d in row.get("vs_legs", {}).items()
            )
            print(
                f"| {row['run']} | {row['tuned']['ndcg10']:.4f} | {row['tuned']['recall10']:.4f} | "
                f"{row['held_out']['ndcg10']:.4f} | {row['held_out']['recall10']:.4f} | {versus} |"
            )


async def run(base_dsn: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await language(lang, base_dsn, args) for lang in args.lang]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lang", nargs="+", choices=("en", "zh"), default=["zh", "en"])
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "ragstream-default-embedder")
    parser.add_argument("--out", type=Path, help="JSON results (per-query figures left out)")
    parser.add_argument("--models", nargs="+", help="instead of the candidates of each language")
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    if dsn := os.environ.get("DATABASE_URL"):
        reports = asyncio.run(run(dsn, args))
    else:
        with EmbeddedPostgres(args.data_dir / "postgres") as server:
            reports = asyncio.run(run(server.dsn, args))
    print_table(reports)
    if args.out:
        for report in reports:
            for row in report["rows"]:
                for part in ("tuned", "held_out"):
                    row[part] = {key: value for key, value in row[part].items() if key != "run"}
        args.out.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
