"""Small work beside LlamaIndex: first ingest, unchanged re-sync and 10 edited pages, each a fresh process.

    .venv/bin/python -m bench.compare_resync [--limit 300] [--rounds 2] [--repeats 1] [--edits 10]
                                             [--li-python PATH] [--ragstream PATH]

Each round makes one copy of the first ``--limit`` pages of the PostgreSQL 15 documentation
(``bench.ingest``'s corpus) that both systems sync, then runs three phases, alternating the two
systems within each phase (LlamaIndex first in odd rounds, ragstream first in even ones):

1. ``first``: the first ingest (the setup of the two that follow);
2. ``unchanged``: the same pages again, nothing changed;
3. ``edited``: after ``--edits`` pages of the copy got one paragraph each (the baseline's
   ``edit_pages``: the same pages, the same edit, for both).

With ``--repeats N`` a round runs phases 2 and 3 N times after its first ingest (each edit adds one
more paragraph to the same pages): more re-sync figures for one costly first ingest.

* LlamaIndex: ``bench/llamaindex/llamaindex_baseline.py --phase ingest`` (``IngestionPipeline`` with
  ``DocstoreStrategy.UPSERTS`` and a persisted ``SimpleDocumentStore``) against one PostgreSQL 16.2 +
  pgvector 0.6.2 of the ``pgserver`` wheel (``bench/llamaindex/pg_up.sh``), started once before the
  rounds: its start and stop are not part of any LlamaIndex run. Its virtualenv is
  ``bench.compare_llamaindex``'s (``--li-python``, else made under ``.cache/bench/llamaindex-venv``).
* ragstream: the command a user runs, ``ragstream ingest FOLDER`` with ``RAGSTREAM_DATA_DIR`` set to the
  round's folder and default settings: its embedded PostgreSQL starts and stops inside each run.
  Python may write its bytecode cache (``PYTHONDONTWRITEBYTECODE`` is dropped from its environment), as
  for the baseline's pip-installed packages: the first ingest compiles the sources, later runs reuse them.
  ``--ragstream`` names another build's command (a checkout's ``.venv/bin/ragstream``), for a
  before/after comparison.

Timed: the wall time of each process, from its start to its exit, and the CPU seconds of it and its
children; the 1-minute load average is read before each run. Printed as a table, with the
ragstream/LlamaIndex ratio of the wall times per round and phase, and written to
``bench/results/compare-resync-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.compare_llamaindex import (  # noqa: E402
    LLAMAINDEX,
    bench_workdir,
    llamaindex_postgres,
    llamaindex_python,
    run_timed,
    timed,
)
from bench.ingest import RESULTS, git_state, log, prepare_corpus  # noqa: E402

PHASES = ("first", "unchanged", "edited")
# The summary line of ``ragstream ingest``: "FOLDER: 300 listed, 290 unchanged, 10 indexed (137 chunks), ..."
_SUMMARY = re.compile(r"(\d+) listed, (\d+) unchanged, (\d+) indexed \((\d+) chunks\)")


def baseline_module() -> ModuleType:
    """``llamaindex_baseline.py`` as a module, for its ``edit_pages`` (it imports LlamaIndex only inside
    its phases, so this python can load it)."""
    spec = importlib.util.spec_from_file_location("llamaindex_baseline", LLAMAINDEX / "llamaindex_baseline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_llamaindex(python: Path, dsn: str, workdir: Path, label: str, phase: str, repeat: int) -> dict[str, Any]:
    """One ``--phase ingest`` process of the baseline on ``workdir/corpus`` (its docstore in ``workdir``)."""
    load = os.getloadavg()[0]
    result, wall, cpu = timed(
        [
            str(python),
            str(LLAMAINDEX / "llamaindex_baseline.py"),
            *("--phase", "ingest", "--label", f"{label}/{phase}/{repeat}", "--corpus", str(workdir / "corpus")),
            *("--dsn", dsn, "--workdir", str(workdir), "--table", f"li_{label}"),
        ]
    )
    return {
        "system": "llamaindex",
        "round": label,
        "phase": phase,
        "repeat": repeat,
        "load1_before": round(load, 2),
        "process_wall_s": round(wall, 2),
        "process_cpu_s": round(cpu, 1),
        "documents_listed": result["docs_total"],
        "documents_processed": result["docs_processed"],
        "chunks_embedded": result["texts_embedded"],
        "in_process_ingest_s": result["ingest_s"],
    }


def run_ragstream(command: Path, corpus: Path, data_dir: Path, label: str, phase: str, repeat: int) -> dict[str, Any]:
    """One ``ragstream ingest`` process on ``corpus`` with its embedded PostgreSQL under ``data_dir``."""
    load = os.getloadavg()[0]
    # Bytecode caching on, as for an installed package: the baseline's packages were byte-compiled by pip,
    # while an editable checkout run with PYTHONDONTWRITEBYTECODE=1 would compile its sources in every run.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    done, wall, cpu = run_timed(
        [str(command), "ingest", str(corpus)], env={**env, "RAGSTREAM_DATA_DIR": str(data_dir)}, stderr=True
    )
    found = _SUMMARY.search(" ".join(done.stderr.split()))
    if found is None:
        raise SystemExit(f"no summary line in the output of ragstream ingest:\n{done.stderr}")
    listed, unchanged, indexed, chunks = map(int, found.groups())
    return {
        "system": "ragstream",
        "round": label,
        "phase": phase,
        "repeat": repeat,
        "load1_before": round(load, 2),
        "process_wall_s": round(wall, 2),
        "process_cpu_s": round(cpu, 1),
        "documents_listed": listed,
        "documents_processed": indexed,
        "documents_unchanged": unchanged,
        "chunks_written": chunks,
    }


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ragstream's process wall over LlamaIndex's, per round, phase and repeat, in the order they ran."""
    walls = {(run["system"], run["round"], run["phase"], run["repeat"]): run["process_wall_s"] for run in runs}
    steps = list(dict.fromkeys((run["round"], run["phase"], run["repeat"]) for run in runs))
    return [
        {
            "round": step[0],
            "phase": step[1],
            "repeat": step[2],
            "llamaindex_wall_s": walls[("llamaindex", *step)],
            "ragstream_wall_s": walls[("ragstream", *step)],
            "ragstream_over_llamaindex": round(walls[("ragstream", *step)] / walls[("llamaindex", *step)], 3),
        }
        for step in steps
    ]


def table(runs: list[dict[str, Any]], compared: list[dict[str, Any]]) -> str:
    loads = {(run["system"], run["round"], run["phase"], run["repeat"]): run["load1_before"] for run in runs}
    lines = [
        "| round | phase | LlamaIndex wall s (load) | ragstream wall s (load) | ragstream / LlamaIndex |",
        "|---|---|---|---|---|",
    ]
    for row in compared:
        key = (row["round"], row["phase"], row["repeat"])
        phase = row["phase"] if row["phase"] == "first" else f"{row['phase']} {row['repeat']}"
        lines.append(
            f"| {row['round']} | {phase} | {row['llamaindex_wall_s']} ({loads[('llamaindex', *key)]}) "
            f"| {row['ragstream_wall_s']} ({loads[('ragstream', *key)]}) | {row['ragstream_over_llamaindex']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=300, help="the first N pages of postgresql-doc-15; 0: all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="unchanged and edited phases per first ingest")
    parser.add_argument("--edits", type=int, default=10, help="pages edited before each edited phase")
    parser.add_argument("--li-python", default=None, help="python of a virtualenv with LlamaIndex")
    parser.add_argument(
        "--ragstream", default=str(Path(sys.executable).with_name("ragstream")), help="the ragstream command to time"
    )
    args = parser.parse_args(argv)

    corpus = prepare_corpus("postgresql-doc-15", args.limit or None)
    python = llamaindex_python(args.li_python)
    edit_pages = baseline_module().edit_pages
    command = Path(args.ragstream)
    runs: list[dict[str, Any]] = []
    edited: dict[str, list[str]] = {}
    steps = [("first", 0)] + [(phase, repeat) for repeat in range(1, args.repeats + 1) for phase in PHASES[1:]]
    with bench_workdir("ragstream-bench-resync-") as work, llamaindex_postgres(python, work / "pg") as dsn:
        for number in range(1, args.rounds + 1):
            label = f"r{number}"
            workdir = work / label
            shutil.copytree(corpus.folder, workdir / "corpus", ignore=shutil.ignore_patterns(".*"))
            data_dir = workdir / "ragstream-data"
            systems = ["llamaindex", "ragstream"] if number % 2 else ["ragstream", "llamaindex"]
            for phase, repeat in steps:
                if phase == "edited":
                    edited[label] = edit_pages(workdir / "corpus", args.edits, f"{label}, edit {repeat}")
                for system in systems:
                    log(f"round {number}, {phase} {repeat}: {system} on {corpus.pages} pages")
                    if system == "llamaindex":
                        runs.append(run_llamaindex(python, dsn, workdir, label, phase, repeat))
                    else:
                        runs.append(run_ragstream(command, workdir / "corpus", data_dir, label, phase, repeat))
                    log(json.dumps(runs[-1]))
    compared = ratios(runs)
    document = {
        "benchmark": "compare-resync",
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "ragstream_command": str(command),
        "corpus": {"package": corpus.package, "version": corpus.package_version, "pages": corpus.pages},
        "edited_pages": edited,
        "runs": runs,
        "ratios": compared,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"compare-resync-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(table(runs, compared))
    print(f"\nwritten to {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
