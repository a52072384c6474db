"""Hybrid search latency beside LlamaIndex on the same pages and the same queries, alternating in rounds.

    .venv/bin/python -m bench.compare_search [--limit 0] [--rounds 3] [--queries 200] [--li-python PATH]

Setup, not timed: one copy of the first ``--limit`` pages of the PostgreSQL 15 documentation
(``bench.ingest``'s corpus; 0: all 1,169) is ingested into both systems:

* LlamaIndex: ``bench/llamaindex/llamaindex_baseline.py --phase ingest`` into one table of a PostgreSQL
  16.2 + pgvector 0.6.2 from the ``pgserver`` wheel (``bench/llamaindex/pg_up.sh``), in the virtualenv
  of ``bench.compare_llamaindex`` (``--li-python``, else made under ``.cache/bench/llamaindex-venv``);
* ragstream: ``ragstream ingest FOLDER`` with ``RAGSTREAM_DATA_DIR`` set to a fresh folder and default
  settings; then ``ragstream up`` serves that folder's index on a free port (gRPC off, no folder to
  sync), with a ``search`` key in ``RAGSTREAM_API_KEYS``, until the end of the rounds.

The queries are the baseline's: ``write_queries`` picks ``--queries`` page titles (seed 42). Each round
runs, in turn (LlamaIndex first in odd rounds, ragstream first in even ones):

* LlamaIndex: the baseline's ``--phase query`` in a fresh process: 5 warm-up queries, then every query
  through the vector retriever and then every query through the hybrid retriever (top-k 10, sparse
  top-k 10, no fusion), the query embedding timed apart from the retrieval; both and their sum reported.
* ragstream: 5 warm-up queries, then every query as ``POST /v1/search`` (``top_k`` 10, one query at
  a time over one kept-alive connection), timed in this process from the request to the parsed
  answer: end to end, query embedding, both legs, fusion and the JSON included. The answer's
  ``took_ms`` (the server's own search time) is reported beside it.

Printed: p50/p95/mean per system and round, the 1-minute load average before each run, and per
round ragstream's end-to-end figure over LlamaIndex's hybrid, with and without its query embedding.
Written to ``bench/results/compare-search-<timestamp>.json``, with every latency.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.compare_llamaindex import (  # noqa: E402
    LLAMAINDEX,
    bench_workdir,
    llamaindex_postgres,
    llamaindex_python,
    timed,
)
from bench.compare_resync import baseline_module, run_ragstream  # noqa: E402
from bench.ingest import RESULTS, git_state, log, prepare_corpus  # noqa: E402

TOP_K = 10
WARM_UP = 5
LI_TABLE = "li_search"
READY_TIMEOUT_S = 120.0


def summary_ms(latencies_s: list[float]) -> dict[str, float]:
    """p50, p95 (linear interpolation, as the baseline's numpy percentile) and mean, in milliseconds."""
    cuts = statistics.quantiles([seconds * 1000 for seconds in latencies_s], n=100, method="inclusive")
    return {
        "p50_ms": round(cuts[49], 2),
        "p95_ms": round(cuts[94], 2),
        "mean_ms": round(1000 * statistics.fmean(latencies_s), 2),
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def ingest_llamaindex(python: Path, dsn: str, workdir: Path) -> dict[str, Any]:
    """The baseline's ingest phase on ``workdir/corpus`` into ``data_li_search``."""
    result, wall, _ = timed(
        [
            str(python),
            str(LLAMAINDEX / "llamaindex_baseline.py"),
            *("--phase", "ingest", "--label", "search", "--corpus", str(workdir / "corpus")),
            *("--dsn", dsn, "--workdir", str(workdir), "--table", LI_TABLE),
        ]
    )
    return {"documents": result["docs_total"], "chunks": result["chunks"], "process_wall_s": round(wall, 2)}


def query_llamaindex(python: Path, dsn: str, workdir: Path, queries: Path, label: str) -> dict[str, Any]:
    """One baseline ``--phase query`` process; its vector and hybrid figures as three timings each."""
    load = os.getloadavg()[0]
    result, _, _ = timed(
        [
            str(python),
            str(LLAMAINDEX / "llamaindex_baseline.py"),
            *("--phase", "query", "--label", label, "--corpus", str(workdir / "corpus")),
            *("--dsn", dsn, "--workdir", str(workdir), "--table", LI_TABLE),
            *("--top-k", str(TOP_K), "--queries-file", str(queries)),
        ]
    )
    run: dict[str, Any] = {"system": "llamaindex", "round": label, "load1_before": round(load, 2)}
    for mode in ("vector", "hybrid"):
        figures = result[mode]
        for part in ("embed", "retrieve", "total"):
            run[f"{mode}_{part}"] = {stat: figures[f"{part}_{stat}"] for stat in ("p50_ms", "p95_ms", "mean_ms")}
        run[f"{mode}_title_page_found"] = figures["title_page_found"]
    return run


class RagstreamServer:
    """``ragstream up`` on the ingested data folder, for the rounds; stopped with SIGINT (its Ctrl-C)."""

    def __init__(self, command: Path, data_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.key = secrets.token_hex(24)
        env = {**os.environ, "RAGSTREAM_DATA_DIR": str(data_dir), "RAGSTREAM_API_KEYS": f"search:{self.key}"}
        self._log = log_path.open("w")
        self._process = subprocess.Popen(
            [str(command), "up", "--port", str(self.port), "--grpc-port", "0", "--sync-interval", "0"],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise SystemExit(f"ragstream up exited with status {self._process.returncode}; see {self._log.name}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"ragstream up was not ready within {READY_TIMEOUT_S:.0f} s; see {self._log.name}")

    def stop(self) -> None:
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)
        self._log.close()


def query_ragstream(server: RagstreamServer, queries: list[dict[str, str]], label: str) -> dict[str, Any]:
    """Every query through ``POST /v1/search``, one at a time, timed from request to parsed answer."""
    load = os.getloadavg()[0]
    headers = {"Authorization": f"Bearer {server.key}"}
    end_to_end: list[float] = []
    server_side: list[float] = []
    found = 0
    results = 0
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        for query in queries[:WARM_UP]:
            client.post("/v1/search", json={"query": query["query"], "top_k": TOP_K}).raise_for_status()
        for query in queries:
            started = time.perf_counter()
            response = client.post("/v1/search", json={"query": query["query"], "top_k": TOP_K})
            response.raise_for_status()
            answer = response.json()
            end_to_end.append(time.perf_counter() - started)
            server_side.append(answer["took_ms"] / 1000)
            results += len(answer["results"])
            found += any(result["source"] == query["page"] for result in answer["results"])
    return {
        "system": "ragstream",
        "round": label,
        "load1_before": round(load, 2),
        "http_end_to_end": summary_ms(end_to_end),
        "server_took": summary_ms(server_side),
        "mean_results": round(results / len(queries), 1),
        "title_page_found": round(found / len(queries), 3),
        "latencies_ms": [round(seconds * 1000, 2) for seconds in end_to_end],
    }


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round: ragstream's HTTP end to end over LlamaIndex's hybrid, with and without its embedding."""
    compared = []
    for label in dict.fromkeys(run["round"] for run in runs):
        li = next(run for run in runs if run["system"] == "llamaindex" and run["round"] == label)
        rs = next(run for run in runs if run["system"] == "ragstream" and run["round"] == label)
        row: dict[str, Any] = {"round": label}
        for stat in ("p50_ms", "p95_ms", "mean_ms"):
            name = stat.removesuffix("_ms")
            row[f"{name}_over_hybrid_total"] = round(rs["http_end_to_end"][stat] / li["hybrid_total"][stat], 3)
            row[f"{name}_over_hybrid_retrieve"] = round(rs["http_end_to_end"][stat] / li["hybrid_retrieve"][stat], 3)
        compared.append(row)
    return compared


def figure(timing: dict[str, float]) -> str:
    return f"{timing['p50_ms']} / {timing['p95_ms']} / {timing['mean_ms']}"


def table(runs: list[dict[str, Any]], compared: list[dict[str, Any]]) -> str:
    lines = [
        "| round | system, measure | load 1-min | p50 / p95 / mean ms | title's page in top 10 |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        first = f"| {run['round']} | "
        if run["system"] == "llamaindex":
            for mode in ("hybrid", "vector"):
                found = f"{run[f'{mode}_title_page_found']:.1%}"
                for part, name in (("total", "with query embedding"), ("retrieve", "retrieve only")):
                    lines.append(
                        f"{first}LlamaIndex {mode}, {name} | {run['load1_before']} "
                        f"| {figure(run[f'{mode}_{part}'])} | {found} |"
                    )
        else:
            lines.append(
                f"{first}ragstream HTTP, end to end | {run['load1_before']} | {figure(run['http_end_to_end'])} "
                f"| {run['title_page_found']:.1%} |"
            )
            lines.append(f"{first}ragstream, server's took_ms | | {figure(run['server_took'])} | |")
    lines += [
        "",
        "| round | RS/LI hybrid with embedding p50 / p95 / mean | RS/LI hybrid retrieve only p50 / p95 / mean |",
        "|---|---|---|",
    ]
    for row in compared:
        lines.append(
            f"| {row['round']} | {row['p50_over_hybrid_total']} / {row['p95_over_hybrid_total']} "
            f"/ {row['mean_over_hybrid_total']} | {row['p50_over_hybrid_retrieve']} "
            f"/ {row['p95_over_hybrid_retrieve']} / {row['mean_over_hybrid_retrieve']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0, help="the first N pages of postgresql-doc-15; 0: all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queries", type=int, default=200, help="page titles, as the baseline picks them")
    parser.add_argument("--li-python", default=None, help="python of a virtualenv with LlamaIndex")
    parser.add_argument(
        "--ragstream", default=str(Path(sys.executable).with_name("ragstream")), help="the ragstream command"
    )
    args = parser.parse_args(argv)

    corpus = prepare_corpus("postgresql-doc-15", args.limit or None)
    python = llamaindex_python(args.li_python)
    command = Path(args.ragstream)
    runs: list[dict[str, Any]] = []
    with bench_workdir("ragstream-bench-search-") as work:
        shutil.copytree(corpus.folder, work / "corpus", ignore=shutil.ignore_patterns(".*"))
        queries_path = work / "queries.json"
        baseline_module().write_queries(work / "corpus", args.queries, queries_path)
        queries = json.loads(queries_path.read_text(encoding="utf-8"))
        with llamaindex_postgres(python, work / "pg") as dsn:
            data_dir = work / "ragstream-data"
            server: RagstreamServer | None = None
            try:
                log(f"ingest: LlamaIndex on {corpus.pages} pages")
                li_ingest = ingest_llamaindex(python, dsn, work)
                log(f"ingest: ragstream on {corpus.pages} pages")
                rs_ingest = run_ragstream(command, work / "corpus", data_dir, "setup", "first", 0)
                log(json.dumps({"llamaindex": li_ingest, "ragstream": rs_ingest}))
                server = RagstreamServer(command, data_dir, work / "ragstream-up.log")
                server.wait_ready()
                for number in range(1, args.rounds + 1):
                    label = f"r{number}"
                    for system in ["llamaindex", "ragstream"] if number % 2 else ["ragstream", "llamaindex"]:
                        log(f"round {number}: {system}, {len(queries)} queries")
                        if system == "llamaindex":
                            runs.append(query_llamaindex(python, dsn, work, queries_path, label))
                        else:
                            runs.append(query_ragstream(server, queries, label))
                        log(json.dumps({key: value for key, value in runs[-1].items() if key != "latencies_ms"}))
            finally:
                if server is not None:
                    server.stop()
    compared = ratios(runs)
    document = {
        "benchmark": "compare-search",
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "corpus": {"package": corpus.package, "version": corpus.package_version, "pages": corpus.pages},
        "queries": len(queries),
        "top_k": TOP_K,
        "ingest": {"llamaindex": li_ingest, "ragstream": rs_ingest},
        "runs": runs,
        "ratios": compared,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compare-search-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(table(runs, compared))
    print(f"\nwritten to {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
