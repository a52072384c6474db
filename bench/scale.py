"""Search latency at 10k, 100k (and with ``--million`` 1M) chunks of real documentation text.

    .venv/bin/python -m bench.scale [--sizes 10000,100000] [--million] [--queries 200] [--http-seconds 60] \
        [--build-memory 2GB]

1. **Corpus.** ``apt-get download`` of Debian documentation packages (``rust-doc``, ``python3.11-doc``,
   ``linux-doc-6.1``, ``openjdk-17-doc``; any missing from the archive is skipped) into
   ``.cache/bench/scale/debs/``, unpacked once with ``dpkg-deb -x``. Every ``*.html``, ``*.txt`` and
   ``*.rst`` file, sorted by path, becomes a document: tags stripped, text packed into chunks of about
   1,000 characters at paragraph breaks, the ``<title>`` (or file name) as title. When the packages run
   out the documents are repeated under new ids (``#2``, ``#3``, ...).
2. **Load.** One embedded PostgreSQL (fresh, or kept in ``--data-dir``), the schema by the migrations
   and the local embedder's space activated by ``open_runtime``. Documents go in 100 per transaction
   by ``write_chunks``' statement over many documents (the same tsvectors; the triggers of migrations
   0004 and 0017 write bigrams, postings and frequencies as for any commit), vectors by COPY:
   synthetic (random, unit length, the embedder's dimension). The HNSW index is dropped while the
   corpus grows from one size to the next and built again after; both times are reported.
3. **Legs.** For each size, ``--queries`` queries (distinct page titles of at least two words, fixed
   seed) run one at a time, each in its own ``SearchStore.snapshot()`` as the retriever runs them:
   the keyword leg (top 30, impact-ordered postings and the whole term lists of the settings' memory,
   as the retriever builds it; the path each took is counted) over all queries twice, after the lists
   of the most frequent terms were loaded ahead as a retriever's start loads them (time reported), the
   first pass loading the other lists its searches need, the second finding them kept; the keyword leg
   with every match scored (``impact_ordered=False``, on ``--exact-queries`` of them), and the vector
   leg (top 30) with a synthetic query vector.
4. **HTTP end to end.** ``ragstream up`` on 127.0.0.1 with ``DATABASE_URL`` pointing at this server,
   then ``--callers`` concurrent callers send ``POST /v1/search`` (hybrid, query embedding included)
   back to back for ``--http-seconds``; p50/p95 and every non-200 answer as an error.

Printed: a table per size, index and table sizes, build times and the load average before each step.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import itertools
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import numpy as np

from ragstream.core.search import SearchFilters
from ragstream.runtime import keyword_postings, open_runtime
from ragstream.segmentation import query_terms, segment
from ragstream.settings import Settings
from ragstream.storage.documents import chunk_id, document_id
from ragstream.storage.embedded_postgres import EmbeddedPostgres
from ragstream.storage.postings import refresh_impacts
from ragstream.storage.scope import Scope
from ragstream.storage.search import SearchStore

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("rust-doc", "python3.11-doc", "linux-doc-6.1", "openjdk-17-doc")
CONNECTION = "scale"
LEG = 30
CHUNK_CHARS = 1000
BATCH_DOCUMENTS = 100


@dataclass
class Document:
    path: str
    title: str
    chunks: list[str]


def unpack(cache: Path) -> Path:
    """The packages downloaded and unpacked under ``cache`` (once)."""
    debs, root = cache / "debs", cache / "unpacked"
    debs.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        if not list(debs.glob(f"{package}_*.deb")):
            fetched = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
            if fetched.returncode:
                print(f"  {package}: not downloaded ({fetched.stderr.strip()[:200]})", file=sys.stderr)
    for deb in sorted(debs.glob("*.deb")):
        marker = root / f".{deb.name}.done"
        if not marker.exists():
            root.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            marker.touch()
    return root


_DROP = re.compile(r"<(script|style|nav|head)\b.*?</\1\s*>", re.S | re.I)
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.S | re.I)
_BLOCK = re.compile(r"<(?:p|div|h[1-6]|li|pre|tr|br|section|dt|dd)\b[^>]*>", re.I)
_TAG = re.compile(r"<[^>]+>")


def text_of(path: Path) -> tuple[str, str]:
    """Title and plain text (paragraphs separated by blank lines) of one file."""
    raw = path.read_text(errors="replace")
    if path.suffix != ".html":
        return path.stem, raw
    title_match = _TITLE.search(raw)
    title = " ".join(html.unescape(_TAG.sub("", title_match.group(1))).split()) if title_match else path.stem
    body = _BLOCK.sub("\n\n", _DROP.sub(" ", raw))
    return title, html.unescape(_TAG.sub(" ", body))


def chunks_of(text: str) -> list[str]:
    chunks: list[str] = []
    current = ""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        if not paragraph:
            continue
        while len(paragraph) > CHUNK_CHARS:
            chunks.append(paragraph[:CHUNK_CHARS])
            paragraph = paragraph[CHUNK_CHARS:]
        if len(current) + len(paragraph) > CHUNK_CHARS and current:
            chunks.append(current)
            current = ""
        current = f"{current} {paragraph}".strip()
    if current:
        chunks.append(current)
    return chunks


def documents(root: Path) -> Iterator[Document]:
    """Every document of the packages, then again under new ids, forever."""
    paths = sorted(p for p in root.rglob("*") if p.suffix in (".html", ".txt", ".rst") and p.is_file())
    if not paths:
        raise SystemExit(f"no documentation files under {root}")
    parsed: list[Document] = []
    for path in paths:
        title, text = text_of(path)
        chunks = chunks_of(text)
        if chunks:
            document = Document(str(path.relative_to(root)), title, chunks)
            parsed.append(document)
            yield document
    for repetition in itertools.count(2):
        for document in parsed:
            yield Document(f"{document.path}#{repetition}", document.title, document.chunks)


# write_chunks' statement for many documents at once: the same tsvectors and lexeme counts, and the
# triggers of migrations 0004 and 0017 fire as for any writer of chunks.
_INSERT_CHUNKS = """
    INSERT INTO chunks (id, document_id, ordinal, heading, text, search_vector, lexeme_count, acl, index_version)
    SELECT id, document_id, ordinal, '', text, sv,
           (SELECT coalesce(sum(cardinality(lexeme.positions)), 0) FROM unnest(sv) AS lexeme), NULL, 0
    FROM (SELECT id, document_id, ordinal, text,
                 setweight(to_tsvector('english', head), 'A') || to_tsvector('english', body) AS sv
          FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::text[])
          AS t(id, document_id, ordinal, text, head, body)) AS prepared
"""


async def grow(
    pool: asyncpg.Pool, table: str, dimension: int, source: Iterator[Document], target: int, build_memory: str
) -> dict[str, float]:
    """Add documents until the corpus holds ``target`` chunks, the HNSW index dropped meanwhile and
    built again after (with ``build_memory`` of maintenance_work_mem); the seconds each part took."""
    have = int(await pool.fetchval("SELECT count(*) FROM chunks"))
    if have >= target:
        return {"chunks_s": 0.0, "hnsw_s": await build_hnsw(pool, table, build_memory)}
    rng = np.random.default_rng(have)
    await pool.execute(f"DROP INDEX IF EXISTS {table}_hnsw")
    started = time.perf_counter()
    while have < target:
        batch = []
        while len(batch) < BATCH_DOCUMENTS and have < target:
            document = next(source)
            batch.append(Document(document.path, document.title, document.chunks[: target - have]))
            have += len(batch[-1].chunks)
        keys = [document_id(CONNECTION, document.path) for document in batch]
        rows = [
            (chunk_id(key, 1, n), key, n, text, segment(document.title), segment(text))
            for key, document in zip(keys, batch, strict=True)
            for n, text in enumerate(document.chunks)
        ]
        vectors = rng.standard_normal((len(rows), dimension)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute(
                "INSERT INTO documents (id, connection_id, external_id, title, source, media_type, content_hash,"
                " version, status, chunk_count) SELECT id, $1, path, title, path, 'text/html', '',"
                " nextval('document_versions'), 'indexed', n FROM unnest($2::text[], $3::text[], $4::text[], $5::int[])"
                " AS t(id, path, title, n)",
                CONNECTION,
                keys,
                [document.path for document in batch],
                [document.title for document in batch],
                [len(document.chunks) for document in batch],
            )
            await connection.execute(_INSERT_CHUNKS, *(list(column) for column in zip(*rows, strict=True)))
            await connection.copy_records_to_table(
                table,
                records=list(zip([row[0] for row in rows], list(vectors), strict=True)),
                columns=["chunk_id", "embedding"],
            )
        print(f"  {have}/{target} chunks, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"chunks_s": time.perf_counter() - started, "hnsw_s": await build_hnsw(pool, table, build_memory)}


async def build_hnsw(pool: asyncpg.Pool, table: str, memory: str) -> float:
    """The space's HNSW index as ``spaces.py`` makes it, unless it exists; the seconds it took. A graph
    that outgrows maintenance_work_mem (``memory``) is built on at a fraction of the speed: with the
    64 MB default at 100k 512-d vectors, with 2 GB past about 830k (2026-12-06: from 12 to 1.5 heap
    blocks a second)."""
    if not re.fullmatch(r"[0-9]+[MG]B", memory):
        raise ValueError(f"--build-memory {memory!r}: a size such as 2GB or 512MB")
    started = time.perf_counter()
    async with pool.acquire() as connection:
        await connection.execute(f"SET maintenance_work_mem = '{memory}'")
        await connection.execute(
            f"CREATE INDEX IF NOT EXISTS {table}_hnsw ON {table} USING hnsw (embedding vector_cosine_ops)"
        )
        await connection.execute("RESET maintenance_work_mem")
    return time.perf_counter() - started


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)
    errors: int = 0

    def row(self) -> str:
        if not self.seconds:
            return "– | – | –"
        ordered = sorted(self.seconds)
        p50 = ordered[len(ordered) // 2] * 1000
        p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000
        return f"{p50:.1f} | {p95:.1f} | {len(ordered)}"


async def legs(
    pool: asyncpg.Pool, table: str, dimension: int, queries: list[str], exact_queries: int
) -> dict[str, Any]:
    scope = Scope.build(SearchFilters(), None, first_param=3)
    # The settings' BM25 parameters: the postings' reference (migration 0023) serves only those.
    defaults = Settings()
    bm25 = {"bm25_k1": defaults.bm25_k1, "bm25_b": defaults.bm25_b}
    postings = keyword_postings(defaults)  # as the retriever reads them: whole term lists in the settings' memory
    lists = postings.whole_lists
    assert lists is not None, "RAGSTREAM_KEYWORD_LISTS_MB=0: nothing to load"
    fast = SearchStore(pool, postings=postings, **bm25)
    exact = SearchStore(pool, impact_ordered=False, **bm25)
    rng = np.random.default_rng(7)
    first, second = "keyword, first pass (lists loaded)", "keyword, second pass"
    results = {first: Timings(), second: Timings(), "keyword, every match scored": Timings(), "vector": Timings()}
    for store in (fast, exact):  # cached statistics, warm plans
        async with store.snapshot() as snapshot:
            await snapshot.keyword_leg(query_terms(queries[0]), LEG, scope, query=queries[0])
    started = time.perf_counter()
    warmed = await fast.warm_keyword_lists()  # as a retriever does at its start, in the background
    warming = {"lists": warmed, "seconds": round(time.perf_counter() - started, 1), "kept_mib": lists.used >> 20}
    fast.keyword_paths.clear()
    for index, text in enumerate(queries):
        terms = query_terms(text)
        runs = [(first, fast)] + ([("keyword, every match scored", exact)] if index < exact_queries else [])
        for label, store in runs:
            started = time.perf_counter()
            async with store.snapshot() as snapshot:
                await snapshot.keyword_leg(terms, LEG, scope, query=text)
            results[label].seconds.append(time.perf_counter() - started)
        vector = rng.standard_normal(dimension).astype(np.float32)
        vector /= np.linalg.norm(vector)
        started = time.perf_counter()
        async with fast.snapshot() as snapshot:
            await snapshot.vector_leg(table, vector, LEG, scope)
        results["vector"].seconds.append(time.perf_counter() - started)
    paths, loaded = dict(fast.keyword_paths), lists.loaded
    fast.keyword_paths.clear()
    for text in queries:  # again: the lists the first pass loaded are kept
        started = time.perf_counter()
        async with fast.snapshot() as snapshot:
            await snapshot.keyword_leg(query_terms(text), LEG, scope, query=text)
        results[second].seconds.append(time.perf_counter() - started)
    return {
        "timings": results,
        "paths": paths,
        "second_pass_paths": dict(fast.keyword_paths),
        "lists": {
            "loaded_ahead": warming,
            "loaded": loaded,
            "loaded_in_second_pass": lists.loaded - loaded,
            "kept_mib": lists.used >> 20,
        },
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)


async def http(dsn: str, queries: list[str], callers: int, seconds: float, workdir: Path) -> Timings:
    """``ragstream up`` on this database, ``callers`` concurrent searchers for ``seconds``."""
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": dsn, "RAGSTREAM_SCHEDULER_ENABLED": "false"}
    env["RAGSTREAM_DATA_DIR"] = str(workdir / "up")
    command = [sys.executable, "-c", "from ragstream.cli import app; app()", "up"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", "--sync-interval", "0"]
    log = workdir / "up.log"
    url = f"http://127.0.0.1:{port}"
    timings = Timings()
    process = _start(command, env, log)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ragstream up did not serve:\n{log.read_text()[-3000:]}")
                try:
                    if (await client.post("/v1/search", json={"query": queries[0]})).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
            for text in queries[:4]:  # warm: the embedder's first calls
                await client.post("/v1/search", json={"query": text})
            end = time.monotonic() + seconds

            async def caller(offset: int) -> None:
                index = offset
                while time.monotonic() < end:
                    started = time.perf_counter()
                    try:
                        response = await client.post("/v1/search", json={"query": queries[index % len(queries)]})
                        ok = response.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    timings.seconds.append(time.perf_counter() - started)
                    timings.errors += not ok
                    index += callers

            await asyncio.gather(*(caller(n) for n in range(callers)))
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    return timings


_SIZES = """
    SELECT relname AS name, pg_total_relation_size(oid) AS bytes FROM pg_class
    WHERE relname IN ('chunks', 'chunks_pkey', 'chunks_search_vector_idx', 'chunks_bigram_vector_idx',
                      'keyword_postings', 'keyword_postings_term_impact_idx', 'keyword_postings_chunk_idx',
                      'keyword_df', 'keyword_df_pkey', $1, $2)
    ORDER BY relname
"""


async def sizes(pool: asyncpg.Pool, table: str) -> dict[str, int]:
    index = await pool.fetchval("SELECT indexname FROM pg_indexes WHERE tablename = $1 AND indexdef ~* 'hnsw'", table)
    rows = await pool.fetch(_SIZES, table, index)
    return {row["name"]: int(row["bytes"]) for row in rows}


def queries_of(root: Path, count: int) -> list[str]:
    titles: set[str] = set()
    for path in sorted(root.rglob("*.html")):
        match = _TITLE.search(path.read_text(errors="replace")[:4000])
        if match:
            title = " ".join(html.unescape(_TAG.sub("", match.group(1))).split())
            if len(title.split()) >= 2 and len(title) < 120:
                titles.add(title)
    ordered = sorted(titles)
    random.Random(42).shuffle(ordered)
    return ordered[:count]


async def run(dsn: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    settings = Settings(database_url=dsn)
    reports = []
    queries = queries_of(root, args.queries)
    print(f"{len(queries)} queries", file=sys.stderr)
    async with open_runtime(settings, dsn) as runtime:
        await runtime.store.ensure_connection(CONNECTION, "folder", "Debian documentation")
        model_key, dimension = runtime.embedder.model_key, runtime.embedder.dimension
        table = str(await SearchStore(runtime.pool).embedding_table(model_key))
        source = documents(root)
        for _ in range(int(await runtime.pool.fetchval("SELECT count(*) FROM documents"))):
            next(source)  # a data folder kept from an earlier run: go on after its documents
        for size in args.sizes:
            load = os.getloadavg()
            build = await grow(runtime.pool, table, dimension, source, size, args.build_memory)
            started = time.perf_counter()
            await runtime.pool.execute("VACUUM ANALYZE")
            refreshed = await refresh_impacts(runtime.pool)
            maintenance = time.perf_counter() - started
            measured = await legs(runtime.pool, table, dimension, queries, args.exact_queries)
            postings = await runtime.pool.fetchval("SELECT count(*) FROM keyword_postings")
            report: dict[str, Any] = {
                "chunks": size,
                "postings": postings,
                "build_s": build,
                "vacuum_analyze_refresh_s": maintenance,
                "impacts_refreshed": refreshed,
                "load_before_build": load,
                "load_before_queries": os.getloadavg(),
                "sizes": await sizes(runtime.pool, table),
                "paths": measured["paths"],
                "second_pass_paths": measured["second_pass_paths"],
                "term_lists": measured["lists"],
                "legs": {label: timing.row() for label, timing in measured["timings"].items()},
            }
            if args.http_seconds:
                report["load_before_http"] = os.getloadavg()
                timing = await http(dsn, queries, args.callers, args.http_seconds, args.data_dir)
                report["http"] = timing.row()
                report["http_errors"] = timing.errors
            report["load_after"] = os.getloadavg()
            print(json.dumps(report, indent=1), flush=True)
            reports.append(report)
    return reports


def table(reports: list[dict[str, Any]], callers: int) -> str:
    lines = ["| chunks | measured | p50 ms | p95 ms | n |", "|---:|---|---:|---:|---:|"]
    for report in reports:
        for label, row in report["legs"].items():
            lines.append(f"| {report['chunks']:,} | {label} leg | {row} |")
        if "http" in report:
            lines.append(
                f"| {report['chunks']:,} | HTTP hybrid, {callers} callers, {report['http_errors']} errors"
                f" | {report['http']} |"
            )
    names = sorted(reports[0]["sizes"])
    lines += ["", "| chunks | postings | load s | HNSW build s | " + " | ".join(names) + " (MiB) |"]
    lines.append("|---:|---:|---:|---:|" + "---:|" * len(names))
    for report in reports:
        mib = " | ".join(f"{report['sizes'].get(name, 0) / 2**20:.0f}" for name in names)
        build = report["build_s"]
        lines.append(
            f"| {report['chunks']:,} | {report['postings']:,} | {build['chunks_s']:.0f} | {build['hnsw_s']:.0f}"
            f" | {mib} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000", help="comma-separated chunk counts, ascending")
    parser.add_argument("--million", action="store_true", help="add 1,000,000 chunks to the sizes")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--exact-queries", type=int, default=50, help="of those, also scored exactly")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--http-seconds", type=float, default=60, help="0 skips the HTTP step")
    parser.add_argument("--cache", type=Path, default=REPO / ".cache" / "bench" / "scale")
    parser.add_argument("--data-dir", type=Path, help="the database folder (default: a fresh one under /tmp)")
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument(
        "--build-memory", default="2GB", help="maintenance_work_mem of the HNSW build (about 3GB per million 512-d)"
    )
    args = parser.parse_args()
    args.sizes = sorted({int(size) for size in args.sizes.split(",")} | ({1_000_000} if args.million else set()))
    root = unpack(args.cache)
    fresh = args.data_dir is None
    args.data_dir = args.data_dir or Path("/tmp") / f"ragstream-scale-{uuid.uuid4().hex[:8]}"
    args.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        with EmbeddedPostgres(args.data_dir / "pg") as server:
            reports = asyncio.run(run(server.dsn, args, root))
    finally:
        if fresh:
            shutil.rmtree(args.data_dir, ignore_errors=True)
    print(table(reports, args.callers))
    print(f"load average at the end: {os.getloadavg()}")
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
