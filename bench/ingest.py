"""Ingest throughput, memory and search latency of ragstream on a real documentation corpus.

    .venv/bin/python -m bench.ingest [--corpus postgresql-doc-15] [--limit N]
                                     [--mode embedded|kafka|both] [--queries 300]

The corpus is a Debian documentation package, fetched once with ``apt-get download`` into
``.cache/bench/`` and unpacked with ``dpkg-deb -x``; its HTML pages (the first ``--limit`` in
sorted order, or all) are copied into a corpus folder that both modes sync.

* embedded: a fresh EmbeddedPostgres, ``open_runtime`` with default Settings (local embedder),
  ``pipeline().sync(FolderConnector(corpus))`` in this process.
* kafka: a fresh EmbeddedPostgres, a single-node KRaft broker and the five services as uvicorn
  processes; the fetcher's ``POST /v1/syncs`` starts the sync, and it is complete when every listed
  document is indexed or recorded in ``document_failures``.

Then the same queries (page titles and section headings of the corpus, shuffled with a fixed seed)
run one at a time against that mode's retriever; a hit is the query's own page among the top 10.
Results are printed as a table and written to ``bench/results/ingest-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import os
import platform
import random
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.support is imported from the repository, not installed
    sys.path.insert(0, str(REPO))

import asyncpg  # noqa: E402
import httpx  # noqa: E402

from ragstream.connectors.folder import FolderConnector  # noqa: E402
from ragstream.local_kafka import KafkaNode  # noqa: E402
from ragstream.retrieval import SearchFilters, SearchRequest  # noqa: E402
from ragstream.runtime import open_runtime  # noqa: E402
from ragstream.settings import Settings  # noqa: E402
from ragstream.stages.embed import embedding_input  # noqa: E402
from ragstream.storage.documents import document_id  # noqa: E402
from ragstream.storage.embedded_postgres import EmbeddedPostgres  # noqa: E402
from tests.support.services import MODULES, ServiceProcess  # noqa: E402

CACHE = REPO / ".cache" / "bench"
RESULTS = REPO / "bench" / "results"
# Where each known package keeps its HTML; any other package: every *.html under usr/share/doc.
HTML_ROOTS = {
    "postgresql-doc-15": "usr/share/doc/postgresql-doc-15/html",
    "postgresql-doc-16": "usr/share/doc/postgresql-doc-16/html",
    "rust-doc": "usr/share/doc/rust-doc/html",
    "openjdk-17-doc": "usr/share/doc/openjdk-17-jre-headless/api",
    "linux-doc-6.1": "usr/share/doc/linux-doc-6.1",
}
TOP_K = 10
SEED = 20240601
PROGRESS_EVERY_S = 15.0
STALL_TIMEOUT_S = 900.0  # kafka mode: give up when nothing was indexed or failed for this long
CLK_TCK = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Corpus:
    package: str
    package_version: str
    folder: Path
    pages: int
    total_pages_in_package: int
    bytes: int


def _package_deb(package: str) -> Path:
    """The package's .deb in the cache, downloaded with apt-get the first time."""
    folder = CACHE / "debs"
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(folder.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    log(f"apt-get download {package} (into {folder})")
    done = subprocess.run(["apt-get", "download", package], cwd=folder, capture_output=True, text=True, check=False)
    found = sorted(folder.glob(f"{package}_*.deb"))
    if done.returncode or not found:
        raise SystemExit(f"apt-get download {package} failed (run apt-get update first?):\n{done.stderr}")
    return found[-1]


def _unpacked(package: str) -> tuple[Path, str]:
    """The unpacked package tree (dpkg-deb -x, once) and the package version."""
    deb = _package_deb(package)
    version = deb.name.split("_")[1]
    target = CACHE / "unpacked" / deb.stem
    if not target.exists():
        log(f"dpkg-deb -x {deb.name}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))  # renamed when complete
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
        staging.rename(target)
    return target, version


def prepare_corpus(package: str, limit: int | None) -> Corpus:
    tree, version = _unpacked(package)
    root = tree / HTML_ROOTS.get(package, "usr/share/doc")
    if not root.is_dir():
        raise SystemExit(f"{package}: no {root.relative_to(tree)} in the package")
    pages = sorted((p for p in root.rglob("*.html") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
    total = len(pages)
    chosen = pages[:limit] if limit else pages
    folder = CACHE / "corpus" / f"{package}_{version}-{limit or 'all'}"
    marker = folder / ".complete"  # hidden: the folder connector skips it
    if not (marker.exists() and marker.read_text().strip() == str(len(chosen))):
        log(f"copying {len(chosen)} of {total} pages into {folder}")
        shutil.rmtree(folder, ignore_errors=True)
        for page in chosen:
            target = folder / page.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(page, target)
        marker.write_text(f"{len(chosen)}\n")
    size = sum(p.stat().st_size for p in folder.rglob("*.html"))
    return Corpus(package, version, folder, len(chosen), total, size)


# -------------------------------------------------------------------------------------------- queries

_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_HEADING = re.compile(r"<h([23])\b[^>]*>(.*?)</h\1\s*>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]+>")
# "9.4.1. ", "Chapter 9. ", "Part II. ", "Appendix F. ", "F.3. ", "Table 9.1. "
_NUMBERING = re.compile(
    r"^(?:(?:chapter|part|appendix|table|example|figure)\s+)?(?:[A-Z]|[IVXLC]+|\d+)(?:\.\d+)*\.\s+", re.IGNORECASE
)


@dataclass(frozen=True)
class Query:
    query: str
    source: str  # the page it was taken from: the expected hit
    kind: str  # title, h2 or h3


def _clean(fragment: str) -> str:
    text = re.sub(r"\s+", " ", html.unescape(_TAG.sub("", fragment))).strip()
    return _NUMBERING.sub("", text).strip()


def build_queries(corpus: Corpus, count: int, seed: int = SEED) -> tuple[list[Query], int]:
    """Titles and h2/h3 headings that occur on exactly one page, shuffled; returns (chosen, candidates)."""
    per_page: list[Query] = []
    for page in sorted(corpus.folder.rglob("*.html")):
        text = page.read_text(encoding="utf-8", errors="replace")
        source = page.relative_to(corpus.folder).as_posix()
        found: dict[str, Query] = {}
        title = _TITLE.search(text)
        if title:
            found.setdefault(_clean(title[1]).lower(), Query(_clean(title[1]), source, "title"))
        for level, fragment in _HEADING.findall(text):
            cleaned = _clean(fragment)
            found.setdefault(cleaned.lower(), Query(cleaned, source, f"h{level}"))
        per_page.extend(q for q in found.values() if len(q.query) >= 8 and len(q.query.split()) >= 2)
    pages_per_text = Counter(q.query.lower() for q in per_page)
    unique = [q for q in per_page if pages_per_text[q.query.lower()] == 1]  # ambiguous texts have no one answer
    random.Random(seed).shuffle(unique)
    return unique[:count], len(unique)


# ---------------------------------------------------------------------------------- processes, memory


def _status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def postgres_pids(data_dir: Path) -> list[int]:
    """The postmaster of ``data_dir`` and its children (backends, checkpointer, wal writer...)."""
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    return [postmaster, *_children(postmaster)]


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLK_TCK


def _command_label(pid: int) -> str:
    """A short name for a process: ``python -m pytest``, ``python bench/quality.py``, ``java kafka.Kafka``."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "[kernel]"
    program = Path(argv[0]).name
    if program.startswith("python"):
        rest = argv[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return f"python -m {rest[1].split(':')[0]}"
        return f"python {rest[0]}" if rest else "python"
    if program == "java":
        main_class = next((a for a in argv[1:] if re.fullmatch(r"[a-z]+(\.[A-Za-z_]+)+", a)), "")
        return f"java {main_class}".strip()
    if program.startswith("postgres"):
        return "postgres"
    return program[:40]


class Sampler(threading.Thread):
    """Every second: VmHWM and CPU seconds of each process of each group, the load average, and the
    CPU seconds of every other process by command (this machine is shared)."""

    def __init__(self, groups: dict[str, Callable[[], list[int]]], interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.groups = groups
        self.interval = interval
        self.hwm_kb: dict[str, dict[int, int]] = {name: {} for name in groups}
        self.cpu_s: dict[str, dict[int, float]] = {name: {} for name in groups}
        self.first_cpu_s: dict[str, dict[int, float]] = {name: {} for name in groups}
        self.samples = 0
        self.max_load1 = 0.0
        self.foreign_cpu_s: dict[str, float] = {}
        self._foreign_last: dict[int, float] = {}
        self._labels: dict[int, str] = {}
        self._started_ticks: int | None = None
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def sample(self) -> None:
        with self._lock:
            self._sample()

    def checkpoint(self) -> tuple[dict[str, float], dict[str, float]]:
        """Sample now; CPU seconds per group, and of the busiest other commands, so far."""
        with self._lock:
            self._sample()
            return {name: self.cpu_used(name) for name in self.groups}, self.foreign_top()

    def _sample(self) -> None:
        ours = {os.getpid()}
        for name, pids_of in self.groups.items():
            for pid in pids_of():
                ours.add(pid)
                if (hwm := _status_kb(pid, "VmHWM")) is not None:
                    self.hwm_kb[name][pid] = max(hwm, self.hwm_kb[name].get(pid, 0))
                if (cpu := _cpu_seconds(pid)) is not None:
                    self.cpu_s[name][pid] = cpu
                    self.first_cpu_s[name].setdefault(pid, cpu)
        self._sample_foreign(ours)
        self.samples += 1
        self.max_load1 = max(self.max_load1, os.getloadavg()[0])

    def _sample_foreign(self, ours: set[int]) -> None:
        uptime_ticks = int(float(Path("/proc/uptime").read_text().split()[0]) * CLK_TCK)
        first = self._started_ticks is None
        if first:
            self._started_ticks = uptime_ticks
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            pid = int(entry.name)
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cpu, start_ticks, parent = (
                    (int(fields[11]) + int(fields[12])) / CLK_TCK,
                    int(fields[19]),
                    int(fields[1]),
                )
            except (OSError, ValueError, IndexError):
                continue
            if parent in ours:  # pg_ctl, setpriv and other helpers of ours
                continue
            if pid not in self._foreign_last:
                # Seen for the first time: all its CPU counts if it started after us, else none yet.
                started_before = first or start_ticks < (self._started_ticks or 0)
                self._foreign_last[pid] = cpu if started_before else 0.0
                self._labels[pid] = _command_label(pid)
            label = self._labels[pid]
            self.foreign_cpu_s[label] = self.foreign_cpu_s.get(label, 0.0) + cpu - self._foreign_last[pid]
            self._foreign_last[pid] = cpu

    def foreign_top(self, count: int = 6) -> dict[str, float]:
        busiest = sorted(self.foreign_cpu_s.items(), key=lambda item: -item[1])[:count]
        return {label: round(cpu, 1) for label, cpu in busiest if cpu >= 0.5}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
        self.sample()

    def hwm_sum_mb(self, name: str) -> float:
        return round(sum(self.hwm_kb[name].values()) / 1024, 1)

    def hwm_max_mb(self, name: str) -> float:
        return round(max(self.hwm_kb[name].values(), default=0) / 1024, 1)

    def cpu_used(self, name: str) -> float:
        """CPU seconds since the sampler started (processes started later count from zero)."""
        started = self.first_cpu_s[name]
        return round(sum(cpu - started.get(pid, 0.0) for pid, cpu in self.cpu_s[name].items()), 1)


# ------------------------------------------------------------------------------------------- measures


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, -(-int(share * 1000) * len(ordered) // 1000))  # ceil(share * n)
    return ordered[min(rank, len(ordered)) - 1]


def search_summary(latencies_ms: list[float], ranks: list[int | None], server_ms: list[float]) -> dict[str, Any]:
    hits = [rank for rank in ranks if rank is not None]
    summary: dict[str, Any] = {
        "queries": len(latencies_ms),
        "p50_ms": round(percentile(latencies_ms, 0.50), 1),
        "p95_ms": round(percentile(latencies_ms, 0.95), 1),
        "max_ms": round(max(latencies_ms), 1),
        "mean_ms": round(sum(latencies_ms) / len(latencies_ms), 1),
        "hit_rate_at_10": round(len(hits) / len(ranks), 3),
        "mrr_at_10": round(sum(1 / rank for rank in hits) / len(ranks), 3),
        "latencies_ms": [round(x, 1) for x in latencies_ms],
        "ranks": ranks,  # per query, in the order of queries.items; null: not in the top 10
    }
    if server_ms:
        summary["server_took_p50_ms"] = round(percentile(server_ms, 0.50), 1)
        summary["server_took_p95_ms"] = round(percentile(server_ms, 0.95), 1)
    return summary


def first_hit(sources: Iterable[str], expected: str) -> int | None:
    for rank, source in enumerate(sources, start=1):
        if source == expected:
            return rank
    return None


async def listed_ids(corpus: Path) -> tuple[str, list[str]]:
    connector = FolderConnector(corpus)
    ids = [document_id(connector.connection_id, item.external_id) async for item in connector.list_items()]
    return connector.connection_id, ids


_STATE_SQL = """
SELECT count(*) FILTER (WHERE d.status = 'indexed') AS indexed,
       count(*) FILTER (WHERE d.status IS DISTINCT FROM 'indexed' AND f.document_id IS NOT NULL) AS failed,
       coalesce(sum(d.chunk_count) FILTER (WHERE d.status = 'indexed'), 0) AS chunks
FROM unnest($1::text[]) AS l(id)
LEFT JOIN documents d ON d.id = l.id
LEFT JOIN document_failures f ON f.document_id = l.id
"""


async def committed_counts(connection: asyncpg.Connection, ids: list[str]) -> tuple[int, int, int]:
    row = await connection.fetchrow(_STATE_SQL, ids)
    return int(row["indexed"]), int(row["failed"]), int(row["chunks"])


async def database_report(dsn: str, connection_id: str, ids: list[str]) -> dict[str, Any]:
    """What PostgreSQL holds after the sync: the figures both modes are judged by."""
    connection = await asyncpg.connect(dsn)
    try:
        indexed, failed, chunk_count_sum = await committed_counts(connection, ids)
        chunk_rows = await connection.fetchval(
            "SELECT count(*) FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.connection_id = $1 AND d.status = 'indexed'",
            connection_id,
        )
        table = await connection.fetchval("SELECT table_name FROM embedding_spaces LIMIT 1")
        vectors = await connection.fetchval(f"SELECT count(*) FROM {table}") if table else 0
        failures = await connection.fetch(
            "SELECT step, code, count(*) AS n, min(source) AS example, min(message) AS message"
            " FROM document_failures WHERE connection_id = $1 GROUP BY step, code ORDER BY n DESC",
            connection_id,
        )
        texts = await connection.fetch(
            "SELECT d.title, c.heading, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.connection_id = $1 AND d.status = 'indexed'",
            connection_id,
        )
        database_bytes = await connection.fetchval("SELECT pg_database_size(current_database())")
    finally:
        await connection.close()
    return {
        "documents_indexed": indexed,
        "documents_failed": failed,
        "chunks_written": int(chunk_rows),
        # What the embedder was given: the same function builds it at ingest and at re-index.
        "characters_embedded": sum(len(embedding_input(r["title"], r["heading"], r["text"])) for r in texts),
        "chunk_count_sum": chunk_count_sum,
        "vectors_written": int(vectors),
        "database_mb": round(int(database_bytes) / MB, 1),
        "failures_by_reason": [
            {
                "step": r["step"],
                "code": r["code"],
                "count": r["n"],
                "example": r["example"],
                "message": r["message"][:200],
            }
            for r in failures
        ],
    }


def throughput(report: dict[str, Any], listed: int, wall_s: float) -> dict[str, Any]:
    return {
        "documents_listed": listed,
        "ingest_wall_s": round(wall_s, 1),
        "documents_per_s": round(report["documents_indexed"] / wall_s, 2),
        "chunks_per_s": round(report["chunks_written"] / wall_s, 1),
    }


def fresh_postgres_dir(label: str) -> Path:
    # Not under a 0700 folder: as root the server runs as an unprivileged account that must reach it.
    return Path(tempfile.mkdtemp(prefix=f"ragstream-bench-{label}-pg-", dir="/tmp"))


# ------------------------------------------------------------------------------------------- embedded


async def run_embedded(corpus: Corpus, queries: list[Query]) -> dict[str, Any]:
    pg_dir = fresh_postgres_dir("embedded")
    server = EmbeddedPostgres(pg_dir)
    result: dict[str, Any] = {"mode": "embedded"}
    sampler = Sampler({"postgres": lambda: postgres_pids(pg_dir)})
    try:
        started = time.perf_counter()
        dsn = await asyncio.to_thread(server.start)
        result["postgres_start_s"] = round(time.perf_counter() - started, 1)
        settings = Settings()
        async with open_runtime(settings, dsn) as runtime:
            started = time.perf_counter()
            await runtime.embedder.warm_up()
            result["model_load_s"] = round(time.perf_counter() - started, 1)
            connector = FolderConnector(corpus.folder)
            connection_id, ids = await listed_ids(corpus.folder)
            last = [time.monotonic()]

            def progress(p: Any) -> None:
                if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
                    last[0] = time.monotonic()
                    log(f"embedded: {p.indexed + p.failed}/{p.listed} done, {p.failed} failed, {p.chunks} chunks")

            rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            usage_before = resource.getrusage(resource.RUSAGE_SELF)
            busy_before = machine_busy_seconds()
            sampler.start()
            log(f"embedded: syncing {corpus.pages} pages")
            started = time.perf_counter()
            report = await runtime.pipeline().sync(connector, on_progress=progress)
            wall = time.perf_counter() - started
            usage = resource.getrusage(resource.RUSAGE_SELF)
            busy = machine_busy_seconds() - busy_before
            ingest_cpu, others = sampler.checkpoint()
            log(f"embedded: sync done in {wall:.1f} s")
            stored = await database_report(dsn, connection_id, ids)
            p = report.progress
            result["sync_report"] = {
                "listed": p.listed,
                "indexed": p.indexed,
                "chunks": p.chunks,
                "failed": p.failed,
                "report_failures": len(report.failures),
            }
            result.update(throughput(stored, len(ids), wall))
            result.update(stored)
            python_cpu = (usage.ru_utime + usage.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
            result["search"] = await search_embedded(runtime, connection_id, queries)
            sampler.stop()  # before the pool closes: its backends are still alive
            result["memory"] = {
                "python_peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
                "python_peak_rss_before_sync_mb": round(rss_before_kb / 1024, 1),
                "python_peak_rss_after_search_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "postgres_vmhwm_sum_mb": sampler.hwm_sum_mb("postgres"),
                "postgres_vmhwm_max_process_mb": sampler.hwm_max_mb("postgres"),
                "postgres_processes_seen": len(sampler.hwm_kb["postgres"]),
            }
            result["cpu"] = {
                "python_cpu_s": round(python_cpu, 1),
                "postgres_cpu_s": ingest_cpu["postgres"],
                "machine_busy_cpu_s": round(busy, 1),
            }
            result["concurrency"] = {
                "samples": sampler.samples,
                "max_load1": round(sampler.max_load1, 2),
                "other_processes_cpu_s": round(busy - python_cpu - ingest_cpu["postgres"], 1),
                "other_processes_top_cpu_s": others,
            }
    finally:
        if sampler.is_alive():
            sampler.stop()
        await asyncio.to_thread(server.stop)
        shutil.rmtree(pg_dir, ignore_errors=True)
    return result


async def search_embedded(runtime: Any, connection_id: str, queries: list[Query]) -> dict[str, Any]:
    def request(text: str) -> SearchRequest:
        return SearchRequest(query=text, top_k=TOP_K, filters=SearchFilters(connection_ids=[connection_id]))

    await runtime.retriever.search(request("how do I create an index"))  # warm-up
    latencies, ranks, server = [], [], []
    for query in queries:
        started = time.perf_counter()
        response = await runtime.retriever.search(request(query.query))
        latencies.append((time.perf_counter() - started) * 1000)
        server.append(response.took_ms)
        ranks.append(first_hit((r.source for r in response.results), query.source))
    return search_summary(latencies, ranks, server) | {"by_kind": by_kind(queries, ranks)}


def by_kind(queries: list[Query], ranks: list[int | None]) -> dict[str, dict[str, float]]:
    kinds: dict[str, list[int | None]] = {}
    for query, rank in zip(queries, ranks, strict=True):
        kinds.setdefault(query.kind, []).append(rank)
    return {
        kind: {"queries": len(r), "hit_rate_at_10": round(sum(x is not None for x in r) / len(r), 3)}
        for kind, r in sorted(kinds.items())
    }


# ---------------------------------------------------------------------------------------------- kafka

CONSUMERS = ("chunker", "embedder", "indexer")
_WAITING = re.compile(r"- (\S+)\s+\| ragstream-\S+ \|.*waiting for messages")
_ASSIGNED = re.compile(r"- (\S+)\s+\| ragstream-\S+ \|.*assigned to partitions")


def consumers_assigned(services: dict[str, ServiceProcess], limit_s: float = 90.0) -> float:
    """Wait until every subscriber of the consumer services logged its partition assignment.

    Read from FastStream's log lines: aiokafka 0.14's admin client cannot decode Kafka 4.4's
    DescribeGroups response ("Buffer underrun decoding string"), so the broker is not asked.
    """
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        pending = []
        for name in CONSUMERS:
            text = services[name].log_path.read_text(errors="replace")
            subscribed = set(_WAITING.findall(text))
            if not subscribed or not subscribed <= set(_ASSIGNED.findall(text)):
                pending.append(name)
        if not pending:
            time.sleep(1.0)  # a second subscriber of the same group rebalances the first one
            return time.monotonic() - started
        time.sleep(0.25)
    log(f"kafka: consumers {pending} show no partition assignment after {limit_s:.0f} s; starting anyway")
    return time.monotonic() - started


def run_kafka(corpus: Corpus, queries: list[Query]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ragstream-bench-kafka-"))
    pg_dir = fresh_postgres_dir("kafka")
    server = EmbeddedPostgres(pg_dir)
    node = KafkaNode(work / "kafka")
    logs = work / "logs"
    logs.mkdir()
    services: dict[str, ServiceProcess] = {}
    result: dict[str, Any] = {"mode": "kafka"}

    def service_pids(name: str) -> Callable[[], list[int]]:
        def pids() -> list[int]:
            process = services[name].process if name in services else None
            return [process.pid] if process is not None else []

        return pids

    def kafka_pids() -> list[int]:
        return [node._process.pid] if node._process is not None else []

    groups: dict[str, Callable[[], list[int]]] = {name: service_pids(name) for name in MODULES}
    groups |= {"postgres": lambda: postgres_pids(pg_dir), "kafka": kafka_pids}
    sampler = Sampler(groups)
    try:
        started = time.perf_counter()
        dsn = server.start()
        result["postgres_start_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
        bootstrap = node.start()
        result["kafka_start_s"] = round(time.perf_counter() - started, 1)
        env = {"DATABASE_URL": dsn, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
        started = time.perf_counter()
        for name in MODULES:  # started together: each waits on its own model load and migrations lock
            services[name] = ServiceProcess(name, env, logs).start(wait_ready=False)
        for service in services.values():
            service.wait_ready(timeout=240)
        result["services_ready_s"] = round(time.perf_counter() - started, 1)
        result["consumers_assigned_s"] = round(consumers_assigned(services), 1)

        connection_id, ids = asyncio.run(listed_ids(corpus.folder))
        fetcher, retriever = services["connector-fetcher"], services["retriever"]
        sampler.start()
        busy_before = machine_busy_seconds()
        bench_before = resource.getrusage(resource.RUSAGE_SELF)
        log(f"kafka: syncing {corpus.pages} pages through the fetcher")
        with asyncio.Runner() as runner, httpx.Client(timeout=60) as client:
            connection = runner.run(asyncpg.connect(dsn))
            started = time.perf_counter()
            response = client.post(f"{fetcher.url}/v1/syncs", json={"path": str(corpus.folder)})
            if response.status_code != 202:
                raise RuntimeError(f"POST /v1/syncs: {response.status_code} {response.text}")
            announced_s: float | None = None
            fetch_status: dict[str, Any] = {}
            progress_at, last_done, last_change = time.monotonic(), -1, time.monotonic()
            while True:
                if announced_s is None:
                    fetch_status = client.get(f"{fetcher.url}/v1/syncs/{connection_id}").json()
                    if fetch_status["state"] != "syncing":
                        announced_s = time.perf_counter() - started
                        log(f"kafka: fetcher {fetch_status['state']} after {announced_s:.1f} s: {fetch_status}")
                        if fetch_status["state"] != "ready":
                            raise RuntimeError(f"the fetcher's sync failed: {fetch_status}")
                indexed, failed, chunks = runner.run(committed_counts(connection, ids))
                if indexed + failed >= len(ids):
                    break
                now = time.monotonic()
                if indexed + failed != last_done:
                    last_done, last_change = indexed + failed, now
                elif now - last_change > STALL_TIMEOUT_S:
                    raise TimeoutError(f"no progress for {STALL_TIMEOUT_S:.0f} s: {indexed} indexed, {failed} failed")
                for service in services.values():
                    if service.process is not None and service.process.poll() is not None:
                        raise RuntimeError(f"{service.name} exited:\n{service.tail()}")
                if now - progress_at >= PROGRESS_EVERY_S:
                    progress_at = now
                    log(f"kafka: {indexed + failed}/{len(ids)} done, {failed} failed, {chunks} chunks")
                time.sleep(0.25)
            wall = time.perf_counter() - started
            busy = machine_busy_seconds() - busy_before
            ingest_cpu, others = sampler.checkpoint()
            bench_after = resource.getrusage(resource.RUSAGE_SELF)
            bench_cpu = bench_after.ru_utime + bench_after.ru_stime - bench_before.ru_utime - bench_before.ru_stime
            runner.run(connection.close())
        log(f"kafka: all {len(ids)} documents indexed or failed after {wall:.1f} s")
        stored = asyncio.run(database_report(dsn, connection_id, ids))
        result["fetcher_announced_s"] = round(announced_s or wall, 1)
        result["fetcher_counts"] = fetch_status.get("counts", {})
        result.update(throughput(stored, len(ids), wall))
        result.update(stored)
        result["search"] = search_http(retriever, connection_id, queries)
        # Just before stopping: each process's VmHWM is its peak resident set since it started.
        sampler.stop()
        service_hwm = {
            name: round((_status_kb(s.process.pid, "VmHWM") or 0) / 1024, 1)
            for name, s in services.items()
            if s.process
        }
        result["memory"] = {
            "services_vmhwm_sum_mb": round(sum(service_hwm.values()), 1),
            "services_vmhwm_mb": service_hwm,
            "postgres_vmhwm_sum_mb": sampler.hwm_sum_mb("postgres"),
            "postgres_vmhwm_max_process_mb": sampler.hwm_max_mb("postgres"),
            "postgres_processes_seen": len(sampler.hwm_kb["postgres"]),
            "kafka_jvm_vmhwm_mb": sampler.hwm_max_mb("kafka"),
        }
        result["cpu"] = {
            "ingest_cpu_s_by_process": ingest_cpu,
            "services_cpu_s": round(sum(v for k, v in ingest_cpu.items() if k in MODULES), 1),
            "postgres_cpu_s": ingest_cpu["postgres"],
            "kafka_cpu_s": ingest_cpu["kafka"],
            "machine_busy_cpu_s": round(busy, 1),
        }
        result["concurrency"] = {
            "samples": sampler.samples,
            "max_load1": round(sampler.max_load1, 2),
            "other_processes_cpu_s": round(busy - sum(ingest_cpu.values()) - bench_cpu, 1),
            "other_processes_top_cpu_s": others,
            "benchmark_process_cpu_s": round(bench_cpu, 1),
        }
        result["service_log_warnings"] = {
            name: _log_problems(s.log_path) for name, s in services.items() if _log_problems(s.log_path)
        }
    except BaseException:
        for service in services.values():
            log(f"--- {service.name} log tail ---\n{service.tail(20)}")
        raise
    finally:
        if sampler.is_alive():
            sampler.stop()
        for service in services.values():
            service.stop()
        node.stop()
        server.stop()
        shutil.rmtree(pg_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return result


def _log_problems(path: Path) -> dict[str, Any]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    bad = [line for line in lines if re.search(r"\b(ERROR|WARNING|Traceback)\b", line)]
    return {"lines": len(bad), "first": bad[:5]} if bad else {}


def search_http(retriever: ServiceProcess, connection_id: str, queries: list[Query]) -> dict[str, Any]:
    url = f"{retriever.url}/v1/search"

    def body(text: str) -> dict[str, Any]:
        return {"query": text, "top_k": TOP_K, "connection_ids": [connection_id]}

    latencies, ranks, server = [], [], []
    with httpx.Client(timeout=60) as client:
        client.post(url, json=body("how do I create an index")).raise_for_status()  # warm-up
        for query in queries:
            started = time.perf_counter()
            response = client.post(url, json=body(query.query))
            latencies.append((time.perf_counter() - started) * 1000)
            response.raise_for_status()
            payload = response.json()
            server.append(float(payload["took_ms"]))
            ranks.append(first_hit((r["source"] for r in payload["results"]), query.source))
    return search_summary(latencies, ranks, server) | {"by_kind": by_kind(queries, ranks)}


# -------------------------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    memory_kb = _status_line("/proc/meminfo", "MemTotal")
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "nproc": int(nproc) if nproc.isdigit() else os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gb": round((memory_kb or 0) / MB, 1),
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _status_line(path: str, field: str) -> int | None:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes": bool(git("status", "--porcelain"))}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    def get(mode: str, *path: str) -> Any:
        value: Any = results[mode]
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    modes = list(results)
    specs: list[tuple[str, Callable[[str], Any]]] = [
        ("documents listed", lambda m: get(m, "documents_listed")),
        ("documents indexed", lambda m: get(m, "documents_indexed")),
        ("documents failed", lambda m: get(m, "documents_failed")),
        ("chunks written", lambda m: get(m, "chunks_written")),
        ("characters embedded", lambda m: get(m, "characters_embedded")),
        ("ingest wall time (s)", lambda m: get(m, "ingest_wall_s")),
        ("documents/s", lambda m: get(m, "documents_per_s")),
        ("chunks/s", lambda m: get(m, "chunks_per_s")),
        (
            "peak RSS, ragstream processes (MB)",
            lambda m: get(m, "memory", "python_peak_rss_mb") or get(m, "memory", "services_vmhwm_sum_mb"),
        ),
        ("peak RSS, postgres, sum over processes (MB)", lambda m: get(m, "memory", "postgres_vmhwm_sum_mb")),
        ("peak RSS, kafka broker JVM (MB)", lambda m: get(m, "memory", "kafka_jvm_vmhwm_mb")),
        (
            "CPU s, ragstream processes",
            lambda m: get(m, "cpu", "python_cpu_s") or get(m, "cpu", "services_cpu_s"),
        ),
        ("CPU s, postgres (+ kafka)", lambda m: _sum(get(m, "cpu", "postgres_cpu_s"), get(m, "cpu", "kafka_cpu_s"))),
        ("CPU s, whole machine during ingest", lambda m: get(m, "cpu", "machine_busy_cpu_s")),
        ("database size (MB)", lambda m: get(m, "database_mb")),
        ("search queries", lambda m: get(m, "search", "queries")),
        ("search p50 (ms)", lambda m: get(m, "search", "p50_ms")),
        ("search p95 (ms)", lambda m: get(m, "search", "p95_ms")),
        ("search max (ms)", lambda m: get(m, "search", "max_ms")),
        ("search hit rate @10", lambda m: get(m, "search", "hit_rate_at_10")),
        ("search MRR @10", lambda m: get(m, "search", "mrr_at_10")),
        ("CPU s, other processes during ingest", lambda m: get(m, "concurrency", "other_processes_cpu_s")),
    ]
    return [(label, [_cell(fn(mode)) for mode in modes]) for label, fn in specs]


def _sum(*values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return round(sum(present), 1) if present else None


SETUP_KEYS = (
    "postgres_start_s",
    "kafka_start_s",
    "services_ready_s",
    "consumers_assigned_s",
    "model_load_s",
)


def print_report(document: dict[str, Any]) -> None:
    m, c = document["machine"], document["corpus"]
    print()
    print(f"command : {document['command']}")
    print(f"machine : {m['nproc']} CPUs ({m['cpu_model']}), {m['memory_gb']} GB RAM, {m['os']}, kernel {m['kernel']}")
    print(
        f"corpus  : {c['package']} {c['package_version']}: {c['pages']} of {c['total_pages_in_package']} HTML pages, "
        f"{c['mb']} MB"
    )
    print(f"queries : {document['queries']['count']} ({document['queries']['candidates']} candidates, seed {SEED})")
    results = document["results"]
    for mode, result in results.items():
        if "error" in result:
            print(f"{mode}: FAILED: {result['error']}")
    modes = [mode for mode, result in results.items() if "error" not in result]
    if modes:
        rows = table_rows({mode: results[mode] for mode in modes})
        width = max(len(label) for label, _ in rows)
        print()
        print(f"| {'measure'.ljust(width)} | " + " | ".join(mode.rjust(10) for mode in modes) + " |")
        print(f"|{'-' * (width + 2)}|" + "|".join("-" * 11 + ":" for _ in modes) + "|")
        for label, cells in rows:
            print(f"| {label.ljust(width)} | " + " | ".join(cell.rjust(10) for cell in cells) + " |")
    print()
    for mode in modes:
        r = results[mode]
        setup = {k: r[k] for k in SETUP_KEYS if k in r}
        print(f"{mode} setup (s, not in the ingest time): {setup}")
        if r.get("concurrency", {}).get("other_processes_top_cpu_s"):
            print(
                f"{mode}: CPU s of other processes during the ingest: {r['concurrency']['other_processes_top_cpu_s']}"
            )
        if "fetcher_announced_s" in r:
            print(f"{mode}: the fetcher finished announcing after {r['fetcher_announced_s']} s of the ingest")
        for failure in r.get("failures_by_reason", []):
            print(f"{mode} failures: {failure}")
    print(f"results : {document['results_file']}")


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="postgresql-doc-15", help="Debian package with HTML documentation")
    parser.add_argument("--limit", type=int, default=None, help="only the first N HTML pages (sorted by path)")
    parser.add_argument("--mode", choices=("embedded", "kafka", "both"), default="both")
    parser.add_argument("--queries", type=int, default=300, help="search queries per mode")
    parser.add_argument(
        "--compare-llamaindex",
        action="store_true",
        help="first ingest of ragstream and LlamaIndex, alternating (bench.compare_llamaindex; --limit, default 300)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --compare-llamaindex: rounds of both")
    args = parser.parse_args(argv)
    if args.compare_llamaindex:
        # Imported here: that module imports this one.
        from bench.compare_llamaindex import main as compare

        return compare(["--limit", str(args.limit or 300), "--rounds", str(args.rounds)])
    command = shlex.join([".venv/bin/python", "-m", "bench.ingest", *(sys.argv[1:] if argv is None else argv)])

    corpus = prepare_corpus(args.corpus, args.limit)
    queries, candidates = build_queries(corpus, args.queries)
    log(f"corpus {corpus.folder}: {corpus.pages} pages, {corpus.bytes / MB:.1f} MB; {len(queries)} queries")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    document: dict[str, Any] = {
        "benchmark": "ingest",
        "command": command,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_state(),
        "corpus": asdict(corpus) | {"folder": str(corpus.folder), "mb": round(corpus.bytes / MB, 1)},
        "queries": {
            "count": len(queries),
            "candidates": candidates,
            "seed": SEED,
            "top_k": TOP_K,
            "kinds": dict(Counter(q.kind for q in queries)),
            "items": [asdict(q) for q in queries],
        },
        "notes": [
            "Shared 2-core machine: another engineer may run tests concurrently; see concurrency samples and "
            "machine-wide CPU seconds per mode.",
            "Ingest wall time excludes server start-up and the embedding model load (listed separately).",
            "Peak RSS of postgres is the sum of VmHWM over its processes and counts shared buffers more than once.",
            "Embedded: python_peak_rss_mb is ru_maxrss of the benchmark process (embedded runs first).",
            "Search latency is measured at the caller: in-process for embedded, HTTP round trip for kafka.",
        ],
        "results": {},
    }
    failed = False
    modes = ["embedded", "kafka"] if args.mode == "both" else [args.mode]
    for mode in modes:
        code = git_state()  # others may commit between the modes; the services load the code then
        try:
            if mode == "embedded":
                document["results"][mode] = asyncio.run(run_embedded(corpus, queries))
            else:
                document["results"][mode] = run_kafka(corpus, queries)
        except Exception as error:
            failed = True
            log(f"{mode} failed: {type(error).__name__}: {error}")
            document["results"][mode] = {"mode": mode, "error": f"{type(error).__name__}: {error}"}
        document["results"][mode]["git"] = code
    document["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    document["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"ingest-{stamp}.json"
    document["results_file"] = str(path.relative_to(REPO))
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    print_report(document)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
