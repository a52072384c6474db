"""Where an in-process hybrid search spends its time: a stopwatch around each step of the retriever.

    RAGSTREAM_DATA_DIR=DIR .venv/bin/python -m bench.search_split --corpus FOLDER [--queries 200] [--passes 2]

Opens the runtime on a data folder that ``ragstream ingest FOLDER`` filled (its embedded PostgreSQL,
default settings), picks the baseline's ``--queries`` page titles of ``FOLDER`` (``write_queries``,
seed 42, as ``bench.compare_search``), warms up on 5 of them, then runs every query ``--passes``
times through ``runtime.retriever.search`` (top-k 10, one at a time) with a stopwatch around:

* *search*: the whole ``HybridRetriever.search``;
* *embed*: the query embedding (``HybridRetriever._embed``);
* *snapshot open*: the pool wait, the transaction and its settings (``SearchStore.snapshot``);
* *spaces*, *keyword*, *vector legs*, *fusion*, *read-back*: the statements of the snapshot;
* *results*: result texts, previews and citations (``HybridRetriever._results``).

Printed: p50 / p95 / mean per step over every pass, the 1-minute load average before and after,
which path answered the keyword leg (``SearchStore.keyword_paths``) and the share of queries whose
title's page is in the top 10. The steps overlap where the retriever runs them concurrently, so
they need not add up to *search*.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.compare_resync import baseline_module  # noqa: E402
from ragstream.core.search import SearchRequest  # noqa: E402
from ragstream.retrieval.retriever import HybridRetriever  # noqa: E402
from ragstream.runtime import open_runtime, resolve_database  # noqa: E402
from ragstream.settings import Settings  # noqa: E402
from ragstream.storage.search import SearchStore  # noqa: E402

TOP_K = 10
WARM_UP = 5


class Stopwatch:
    """Milliseconds per named step, recorded by the wrappers ``timed`` and ``timed_context`` put in place."""

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = defaultdict(list)

    def timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                self.steps[name].append((time.perf_counter() - started) * 1000)

        return wrapper

    def timed_context(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """An async context manager's entry (what ``snapshot`` costs before the block runs)."""

        @contextlib.asynccontextmanager
        @functools.wraps(method)
        async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            started = time.perf_counter()
            async with method(*args, **kwargs) as value:
                self.steps[name].append((time.perf_counter() - started) * 1000)
                yield value

        return wrapper

    def install(self) -> None:
        """Wrap the retriever's steps, at class level (a snapshot is a copy of the store)."""
        for owner, attribute, name in (
            (HybridRetriever, "search", "search"),
            (HybridRetriever, "_searched_spaces", "spaces"),
            (SearchStore, "keyword_leg", "keyword"),
            (HybridRetriever, "_vector_legs", "vector legs"),
            (HybridRetriever, "_fuse", "fusion"),
            (SearchStore, "chunks", "read-back"),
            (HybridRetriever, "_results", "results"),
        ):
            setattr(owner, attribute, self.timed(name, getattr(owner, attribute)))
        HybridRetriever._embed = staticmethod(self.timed("embed", HybridRetriever._embed))  # type: ignore[method-assign]
        SearchStore.snapshot = self.timed_context("snapshot open", SearchStore.snapshot)  # type: ignore[method-assign]

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: summary_ms(values) for name, values in self.steps.items()}


def summary_ms(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(cuts[49], 2), "p95": round(cuts[94], 2), "mean": round(statistics.fmean(values), 2)}


async def run(corpus: Path, count: int, passes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "queries.json"
        baseline_module().write_queries(corpus, count, path)
        queries = json.loads(path.read_text(encoding="utf-8"))
    settings = Settings()
    async with resolve_database(settings) as dsn, open_runtime(settings, dsn) as runtime:
        retriever = runtime.retriever
        for query in queries[:WARM_UP]:
            await retriever.search(SearchRequest(query=query["query"], top_k=TOP_K))
        watch = Stopwatch()
        watch.install()
        paths = retriever._store.keyword_paths
        paths.clear()
        load_before = os.getloadavg()[0]
        found = 0
        for _ in range(passes):
            for query in queries:
                response = await retriever.search(SearchRequest(query=query["query"], top_k=TOP_K))
                found += any(result.source == query["page"] for result in response.results)
        return {
            "queries": len(queries),
            "passes": passes,
            "load1_before": round(load_before, 2),
            "load1_after": round(os.getloadavg()[0], 2),
            "steps_ms": watch.summary(),
            "keyword_paths": dict(paths),
            "title_page_found": round(found / (len(queries) * passes), 3),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="the folder the data folder was ingested from")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args(argv)
    result = asyncio.run(run(Path(args.corpus), args.queries, args.passes))
    print(
        f"load 1-min {result['load1_before']} before, {result['load1_after']} after;"
        f" {result['queries']} queries x {result['passes']} passes"
    )
    print("| step | p50 | p95 | mean |\n|---|---:|---:|---:|")
    for name, figures in result["steps_ms"].items():
        print(f"| {name} | {figures['p50']} | {figures['p95']} | {figures['mean']} |")
    print(f"keyword paths: {result['keyword_paths']}; title's page in top 10: {result['title_page_found']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
