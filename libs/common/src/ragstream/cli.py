"""The ``ragstream`` command: embedded mode (up), the distributed mode on one machine (run-distributed),
folder sync (ingest), search, sync status, replay, migrations and credential rotation."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import asyncpg
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ragstream.chunking import ChunkingConfig, parse_chunking
from ragstream.connectors.folder import FolderConnector
from ragstream.connectors.registry import register_folder
from ragstream.control.kinds import (
    DEAD_LETTER,
    FAILURES,
    pipeline_replay_kind,
    rechunk_kind,
    reindex_kind,
    sync_kind,
    topic_replay_kind,
)
from ragstream.control.runner import Job, Runner, RunOutcome
from ragstream.credentials import CredentialCipher, CredentialKeyMissing, CredentialsUnreadable
from ragstream.jobs.progress import ReplayProgress, RunProgress
from ragstream.jobs.sync import SyncReport
from ragstream.logs import configure_logging
from ragstream.retrieval import SearchRequest
from ragstream.runtime import Runtime, open_database, open_runtime, resolve_database
from ragstream.settings import EmbeddingProvider, LogSettings, Settings
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.database import apply_migrations, connect_pool, pending_migrations
from ragstream.storage.runs import ConnectionOverview, RagDisabled, RunInProgress, RunKind, RunStatus, RunStore

__all__ = ["app"]

app = typer.Typer(help="ragstream: sync knowledge into PostgreSQL + pgvector and search it.", no_args_is_help=True)
console = Console(stderr=True)
credentials = typer.Typer(help="Encrypted connection credentials.", no_args_is_help=True)
app.add_typer(credentials, name="credentials")


@app.callback()
def _logging() -> None:
    """Every command logs to stderr as ``RAGSTREAM_LOG_LEVEL`` and ``RAGSTREAM_LOG_FORMAT`` say."""
    configure_logging(LogSettings())


def _run(main: Callable[[Runtime], object]) -> object:
    async def runner() -> object:
        settings = Settings()
        async with resolve_database(settings) as dsn, open_runtime(settings, dsn) as runtime:
            result = main(runtime)
            return await result if asyncio.iscoroutine(result) else result

    return asyncio.run(runner())


def _progress_bar(unit: str) -> Progress:
    """Counts, rate in ``unit`` per second, elapsed time and ETA; a task's ``rate`` field feeds it."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"{{task.fields[rate]:.1f}} {unit}/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _report(report: SyncReport, source: str) -> None:
    p = report.progress
    console.print(
        f"[bold]{source}[/]: {p.listed} listed, {p.unchanged} unchanged, {p.indexed} indexed "
        f"({p.chunks} chunks), {p.deleted} deleted, {len(report.failures)} failed"
    )
    if p.skipped:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(p.skipped.items()))
        console.print(f"[bold]{source}[/]: skipped, never indexed: {reasons} (the log names each entry)")
    if report.failures:
        table = Table("document", "step", "reason", title="Documents that did not index")
        for failure in report.failures:
            table.add_row(failure.source, failure.step, f"{failure.code}: {failure.message}")
        console.print(table)


async def _in_foreground(
    runtime: Runtime,
    kind: RunKind,
    connection_id: str | None,
    params: dict[str, Any],
    job: Callable[[RunStore], Job],
    unit: str,
    label: str,
) -> RunOutcome:
    """Run one job of ``kind`` as a run this process owns (trigger ``cli``) in the foreground, with a
    progress bar; no outcome when it could not start (one of its kind and scope is active)."""
    settings = runtime.settings
    runs = RunStore(runtime.pool, runtime.dsn, stale_timeout_s=settings.sync_stale_timeout_s)
    try:
        try:
            run = await runs.start(connection_id, "cli", kind=kind, params=params, running=True)
        except (RunInProgress, RagDisabled, LookupError) as error:
            console.print(f"[bold red]{label}[/]: {error}", highlight=False)
            return RunOutcome(None, None)
        runner = Runner(runs, {kind: job(runs)}, progress_interval_s=settings.sync_progress_interval_s)
        with _progress_bar(unit) as bar:
            task = bar.add_task(f"{kind} {label}", total=None, rate=0.0)

            def show(progress: RunProgress) -> None:
                bar.update(
                    task,
                    total=progress.total if progress.total_known or progress.total else None,
                    completed=progress.done,
                    rate=progress.rate,
                )

            return await runner.execute(run, show)
    finally:
        await runs.aclose()  # ends this process's ownership of the run, if still held


async def _sync_folder(runtime: Runtime, folder: Path, config: dict[str, Any] | None = None) -> RunOutcome:
    """Sync as a run (trigger ``cli``) in the foreground, with a progress bar.

    ``config`` is stored in the connection's config (``--chunker``); None keeps the stored one."""
    connection_id = await register_folder(runtime.store, folder, config)
    label = str(folder.name or folder)
    outcome = await _in_foreground(
        runtime, "sync", connection_id, {}, lambda runs: sync_kind(runs, runtime.pipeline), "docs", label
    )
    if isinstance(outcome.result, SyncReport):
        _report(outcome.result, str(folder))
    elif outcome.run is not None:
        console.print(f"[bold red]{folder}[/]: sync failed: {outcome.run.error}")
    return outcome


def _chunking_config(
    kind: str | None, size: int | None, overlap: int | None, threshold: str | None, amount: float | None
) -> dict[str, Any] | None:
    """The connection config the chunking options ask for, validated; None when none was given."""
    options = {"size": size, "overlap": overlap, "threshold_type": threshold, "threshold_amount": amount}
    given = {key: value for key, value in options.items() if value is not None}
    if kind is None:
        if given:
            raise typer.BadParameter("--chunk-size, --chunk-overlap and --semantic-* need --chunker")
        return None
    try:
        chunking = parse_chunking({"kind": kind, **given})
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or kind}: {e['msg']}" for e in error.errors())
        raise typer.BadParameter(problems, param_hint="--chunker options") from error
    return {"chunking": chunking.model_dump(mode="json")}


@app.command()
def ingest(
    path: Annotated[
        Path, typer.Argument(help="Folder of md, txt, html, pdf and docx files", exists=True, file_okay=False)
    ],
    chunker: Annotated[
        Literal["markdown", "token", "recursive", "semantic"] | None,
        typer.Option(
            "--chunker",
            help="Chunking of this folder's connection, stored and kept for later syncs. When it differs from "
            "the stored one, the indexed files are re-chunked first (as `ragstream rechunk`, search going on). "
            "Unset: the stored choice, else markdown.",
        ),
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option(
            "--chunk-size",
            help="Max chunk size: characters for markdown and recursive (1500), tokens of the embedding model "
            "for token and semantic (512).",
        ),
    ] = None,
    chunk_overlap: Annotated[
        int | None, typer.Option("--chunk-overlap", help="Overlap, in the same unit (markdown/recursive 100, token 0)")
    ] = None,
    semantic_threshold: Annotated[
        Literal["percentile", "std", "iqr", "gradient"] | None,
        typer.Option("--semantic-threshold", help="Where the semantic chunker breaks (percentile)"),
    ] = None,
    semantic_amount: Annotated[
        float | None,
        typer.Option(
            "--semantic-amount", help="Percentile for percentile/gradient (95), multiplier for std (3)/iqr (1.5)"
        ),
    ] = None,
) -> None:
    """Sync a folder: new and changed files are indexed, deleted ones removed. Exit 1 if any failed, if the
    sync itself failed, or if one of this folder was already running."""
    config = _chunking_config(chunker, chunk_size, chunk_overlap, semantic_threshold, semantic_amount)
    folder = path.resolve()

    async def run(runtime: Runtime) -> RunOutcome:
        if config is not None:
            connection_id = FolderConnector(folder).connection_id
            wanted = parse_chunking(config["chunking"])
            current, _ = await runtime.chunker.config_for(connection_id)
            # Already indexed files would otherwise keep chunks of the old config next to new ones.
            stale = wanted != current and bool(await runtime.store.committed(connection_id))
            if stale and not await _rechunk(runtime, connection_id, wanted):
                return RunOutcome(None, None)
        return await _sync_folder(runtime, folder, config=config)

    outcome = _run(run)
    assert isinstance(outcome, RunOutcome)
    raise typer.Exit(0 if isinstance(outcome.result, SyncReport) and outcome.result.ok else 1)


@app.command()
def search(
    query: Annotated[str | None, typer.Argument(help="What to look for")] = None,
    top_k: Annotated[int, typer.Option("--top-k", min=1, max=30)] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (JSONL with --batch)")] = False,
    batch: Annotated[Path | None, typer.Option("--batch", help='JSONL file of {"id", "query"}', exists=True)] = None,
) -> None:
    """Hybrid search over everything indexed."""
    if (query is None) == (batch is None):
        raise typer.BadParameter("give either QUERY or --batch FILE")

    async def run(runtime: Runtime) -> None:
        if batch is not None:
            for line in batch.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                response = await runtime.retriever.search(SearchRequest(query=item["query"], top_k=top_k))
                results = [result.model_dump() for result in response.results]
                sys.stdout.write(json.dumps({"id": item["id"], "results": results}, ensure_ascii=False) + "\n")
            return
        assert query is not None
        response = await runtime.retriever.search(SearchRequest(query=query, top_k=top_k))
        if as_json:
            sys.stdout.write(response.model_dump_json(indent=2) + "\n")
            return
        for result in response.results:
            console.print(f"[bold][{result.citation_index}] {result.title}[/] — {result.source} § {result.heading}")
            console.print(result.text[:300].replace("\n", " "), highlight=False)
            console.print()

    _run(run)


@app.command()
def replay(
    connection: Annotated[str | None, typer.Option("--connection", help="Only this connection's failures")] = None,
    kafka: Annotated[
        str | None,
        typer.Option("--kafka", help="Bootstrap servers: publish to doc.changed for the services instead of in here"),
    ] = None,
    dead_letter: Annotated[
        bool, typer.Option("--dead-letter", help="Re-drive the dead-letter topic (needs --kafka), not the table")
    ] = False,
) -> None:
    """Re-drive failed documents from their staged content. Exit 1 if any still fail (embedded)."""
    if dead_letter and kafka is None:
        raise typer.BadParameter("--dead-letter reads the topic: give --kafka BOOTSTRAP_SERVERS")

    async def replayed(runtime: Runtime, job: Job) -> ReplayProgress | None:
        params = {"source": DEAD_LETTER if dead_letter else FAILURES}
        outcome = await _in_foreground(runtime, "replay", connection, params, lambda _: job, "docs", "failures")
        if outcome.run is not None and outcome.run.error is not None:
            console.print(f"[red]replay failed: {outcome.run.error}[/]", highlight=False)
        return outcome.result if isinstance(outcome.result, ReplayProgress) else None

    async def run(runtime: Runtime) -> bool:
        if kafka is None:
            counts = await replayed(runtime, pipeline_replay_kind(runtime.pipeline))
            failures = await runtime.store.failures(connection)
        else:
            # Imported here, as the API below: every other command starts faster without FastStream.
            from ragstream.kafka import KafkaChangeSink, create_broker, dead_letters

            broker = create_broker(kafka, "replay")
            await broker.start()
            try:
                job = topic_replay_kind(runtime.store, KafkaChangeSink(broker), lambda: dead_letters(kafka))
                counts = await replayed(runtime, job)
            finally:
                await broker.stop()
            failures = []
        if counts is None:
            return False
        console.print(
            f"replayed {counts.replayed}"
            + (
                f" ({counts.indexed} indexed, {counts.failed_again} failed again)"
                if counts.indexed is not None
                else " (published)"
            )
            + f"; {counts.needs_sync} need a sync (failed before staging); {counts.resolved} already resolved"
        )
        if failures:
            table = Table("document", "step", "reason", "retries", title="Documents that still do not index")
            for failure in failures:
                table.add_row(
                    failure.source, failure.step, f"{failure.code}: {failure.message}", str(failure.retry_count)
                )
            console.print(table)
        return not failures

    raise typer.Exit(0 if _run(run) else 1)


@app.command()
def reindex(
    provider: Annotated[
        EmbeddingProvider | None,
        typer.Option("--provider", help="Target provider (with --connection, unset: back to the default model)"),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name (provider default)")] = None,
    dimension: Annotated[int | None, typer.Option("--dimension", min=1, help="Dimension (model default)")] = None,
    base_url: Annotated[str | None, typer.Option("--base-url", help="Endpoint (provider default)")] = None,
    connection: Annotated[
        str | None,
        typer.Option("--connection", help="Only this connection (id, or the folder of a folder connection)"),
    ] = None,
) -> None:
    """Re-embed every chunk with another model while search goes on, then switch to it: the connections
    that follow the default model, or with --connection that one, which then keeps its own model.
    Interrupted, it resumes where it stopped when run again. The key is RAGSTREAM_EMBEDDER_API_KEY.
    Exit 1 if it failed."""
    spec = {"provider": provider, "model": model, "dimension": dimension, "base_url": base_url}
    if provider is None and connection is None:
        console.print("[red]--provider is needed for a deployment-wide re-index[/]")
        raise typer.Exit(2)
    folder = Path(connection) if connection is not None else None
    connection_id = FolderConnector(folder).connection_id if folder is not None and folder.is_dir() else connection

    async def run(runtime: Runtime) -> bool:
        outcome = await _in_foreground(
            runtime,
            "reindex",
            connection_id,
            {"spec": spec if provider is not None else None},
            lambda _: reindex_kind(runtime.reindexer()),
            "chunks",
            connection_id or "the default model",
        )
        done = outcome.run
        if done is None:
            return False
        whose = f"{connection_id}: " if connection_id else ""
        source, target = done.params.get("source_key"), done.params.get("target_key")
        if done.status is RunStatus.SUCCEEDED:
            console.print(f"{whose}search now uses [bold]{target}[/] instead of {source}")
        else:
            console.print(f"[red]{whose}re-index failed, still searching {source}: {done.error}[/]", highlight=False)
        return done.status is RunStatus.SUCCEEDED

    raise typer.Exit(0 if _run(run) else 1)


@app.command()
def rechunk(
    connection: Annotated[str, typer.Argument(help="Connection id, or the folder of a folder connection")],
    chunker: Annotated[
        Literal["markdown", "token", "recursive", "semantic"],
        typer.Option("--chunker", help="The new chunking algorithm"),
    ],
    chunk_size: Annotated[int | None, typer.Option("--chunk-size", help="Max chunk size (as for ingest)")] = None,
    chunk_overlap: Annotated[int | None, typer.Option("--chunk-overlap", help="Overlap (as for ingest)")] = None,
    semantic_threshold: Annotated[
        Literal["percentile", "std", "iqr", "gradient"] | None,
        typer.Option("--semantic-threshold", help="Where the semantic chunker breaks"),
    ] = None,
    semantic_amount: Annotated[float | None, typer.Option("--semantic-amount", help="Threshold amount")] = None,
) -> None:
    """Re-chunk a connection's indexed documents with a new chunking config while search goes on with the
    current chunks, then switch to them. Interrupted, it resumes where it stopped when run again with
    the same options. Exit 1 if it failed."""
    config = _chunking_config(chunker, chunk_size, chunk_overlap, semantic_threshold, semantic_amount)
    assert config is not None
    chunking = parse_chunking(config["chunking"])
    folder = Path(connection)
    connection_id = FolderConnector(folder).connection_id if folder.is_dir() else connection

    raise typer.Exit(0 if _run(lambda runtime: _rechunk(runtime, connection_id, chunking)) else 1)


async def _rechunk(runtime: Runtime, connection_id: str, chunking: ChunkingConfig) -> bool:
    """Re-chunk in the foreground with a progress bar; True when it switched."""
    outcome = await _in_foreground(
        runtime,
        "rechunk",
        connection_id,
        {"chunking": chunking.model_dump(mode="json")},
        lambda _: rechunk_kind(runtime.rechunker()),
        "docs",
        connection_id,
    )
    done = outcome.run
    if done is None:
        console.print(f"[red]cannot re-chunk {connection_id}[/]", highlight=False)
        return False
    if done.status is RunStatus.SUCCEEDED:
        console.print(
            f"{connection_id}: search now uses index version {done.params.get('index_version')}"
            f" ({done.progress.get('chunks')} chunks of {done.progress.get('documents_done')} documents)"
        )
    else:
        console.print(f"[red]re-chunk failed, still searching the previous chunks: {done.error}[/]", highlight=False)
    return done.status is RunStatus.SUCCEEDED


@app.command()
def up(
    folders: Annotated[
        list[Path] | None, typer.Argument(help="Folders to sync, like --source", file_okay=False)
    ] = None,
    source: Annotated[list[Path] | None, typer.Option("--source", help="Folder to sync (repeatable)")] = None,
    port: Annotated[int, typer.Option("--port")] = 8080,
    grpc_port: Annotated[
        int,
        typer.Option("--grpc-port", envvar="RAGSTREAM_GRPC_PORT", min=0, max=65535, help="gRPC API port; 0 disables"),
    ] = 50051,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    sync_interval: Annotated[float, typer.Option("--sync-interval", help="Seconds between syncs; 0 syncs once")] = 3600,
) -> None:
    """Embedded mode: PostgreSQL with pgvector, every stage and the HTTP and gRPC APIs in this process.
    Each folder becomes a connection synced now and on its schedule; `ragstream status` shows its runs."""
    from ragstream.api.auth import Access, AccessSetupError
    from ragstream.embedded import serve
    from ragstream.telemetry import tracer_provider

    tracer_provider("up")  # spans of every request, exported over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set

    try:  # before the store starts: a refused host costs nothing
        access = Access.for_embedded(Settings(), host)
    except AccessSetupError as error:
        console.print(f"[red]cannot serve: {error}[/]", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"ragstream up: HTTP {host}:{port}, gRPC {grpc_port or 'off'}; {access.describe()}", highlight=False)
    paths = [path.resolve() for path in [*(folders or []), *(source or [])]]

    async def main() -> None:
        settings = Settings()
        # The embedded server is handed to serve(), which starts it again if it dies.
        async with open_database(settings) as database, open_runtime(settings, database.dsn) as runtime:
            await serve(
                runtime,
                paths,
                host,
                port,
                sync_interval,
                grpc_port=grpc_port,
                access=access,
                embedded=database.embedded,
            )

    asyncio.run(main())


@app.command("run-distributed")
def run_distributed(
    source: Annotated[list[Path] | None, typer.Option("--source", help="Folder to sync (repeatable)")] = None,
    port: Annotated[int, typer.Option("--port", envvar="PORT", help="Search API (retriever) port")] = 8080,
    control_port: Annotated[
        int, typer.Option("--control-port", envvar="CONTROL_PORT", help="Control-plane API (connector-fetcher) port")
    ] = 8081,
    grpc_port: Annotated[
        int,
        typer.Option("--grpc-port", envvar="RAGSTREAM_GRPC_PORT", min=0, max=65535, help="gRPC API port; 0 disables"),
    ] = 50051,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    sync_interval: Annotated[float, typer.Option("--sync-interval", help="Seconds between syncs", min=1)] = 3600,
) -> None:
    """Distributed mode on this machine: Apache Kafka, PostgreSQL with pgvector and the five services as
    separate processes; search on --port, the control-plane API on --control-port. Ctrl-C stops all."""
    from ragstream.distributed import DistributedOptions
    from ragstream.distributed import run_distributed as launch

    options = DistributedOptions(
        host=host,
        port=port,
        control_port=control_port,
        grpc_port=grpc_port,
        sources=[path.resolve() for path in source or []],
        sync_interval_s=sync_interval,
        data_dir=Settings().data_dir,
    )
    raise typer.Exit(launch(options))


@app.command()
def models() -> None:
    """Print the Maven coordinates of the BGE models the bilingual embedders run, one per line: ``make
    models`` fetches each with ``mvn dependency:get``, and the embedder unpacks it from the local Maven
    repository instead of downloading it on first use."""
    from ragstream.embedding.bilingual import bge_model_names
    from ragstream.embedding.onnx import MODELS

    for name in bge_model_names():
        typer.echo(MODELS[name].coordinates)


@app.command()
def migrate(
    database_url: Annotated[
        str | None, typer.Option("--database-url", help="PostgreSQL DSN; default DATABASE_URL, else the embedded store")
    ] = None,
    wait: Annotated[
        float | None,
        typer.Option(
            "--wait",
            help="Apply nothing: wait up to this many seconds until the migrations are applied (by another "
            "process, e.g. the deployment's migration Job), then exit 0; else exit 1",
            min=0,
        ),
    ] = None,
) -> None:
    """Apply the database migrations not applied yet; the deployments run this as a Job before the services."""
    settings = Settings(database_url=database_url) if database_url else Settings()

    async def apply() -> list[str]:
        async with resolve_database(settings) as dsn:
            return await apply_migrations(dsn)

    async def applied_elsewhere(timeout_s: float) -> list[str]:
        """What is still pending at the deadline (the database unreachable meanwhile counts as pending)."""
        deadline = time.monotonic() + timeout_s
        async with resolve_database(settings) as dsn:
            while True:
                try:
                    pending = await pending_migrations(dsn)
                except (OSError, asyncpg.PostgresError) as error:
                    pending = [f"(database unreachable: {error})"]
                if not pending or time.monotonic() >= deadline:
                    return pending
                await asyncio.sleep(2)

    if wait is None:
        applied = asyncio.run(apply())
        typer.echo(f"{len(applied)} migration(s) applied" + (": " + ", ".join(applied) if applied else ""))
        return
    pending = asyncio.run(applied_elsewhere(wait))
    if pending:
        console.print(f"[red]migrations still pending after {wait:.0f} s: {', '.join(pending)}[/]", highlight=False)
        raise typer.Exit(1)
    typer.echo("the database schema is current")


def _status_row(item: ConnectionOverview) -> dict[str, Any]:
    # Imported here: the API module brings FastAPI, which `ragstream ingest` must not pay for.
    from ragstream.api.syncs import status_label, sync_counts

    run = item.latest
    progress = run.progress if run is not None else {}
    return {
        "connection_id": item.connection_id,
        "name": item.name,
        "platform": item.platform,
        "rag_enabled": item.rag_enabled,
        "schedule_seconds": item.schedule_seconds,
        "status": status_label(run.status) if run is not None else None,
        "trigger": run.trigger if run is not None else None,
        "reason": run.error if run is not None else None,
        **sync_counts(progress),
        "rate": progress.get("rate"),
        "eta_seconds": progress.get("eta_seconds"),
        "started_at": run.started_at.isoformat() if run is not None and run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run is not None and run.finished_at else None,
        "last_error": item.sync_error,
    }


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list, one object per connection")] = False,
    database_url: Annotated[
        str | None, typer.Option("--database-url", help="PostgreSQL DSN; default DATABASE_URL, else the embedded store")
    ] = None,
) -> None:
    """Each connection's latest sync: status, counts, rate, ETA and last error."""

    async def load() -> list[ConnectionOverview]:
        settings = Settings(database_url=database_url) if database_url else Settings()
        async with resolve_database(settings) as dsn:
            pool = await connect_pool(dsn, max_size=2)
            try:
                return await RunStore(pool, dsn).overview()
            finally:
                await pool.close()

    rows = [_status_row(item) for item in asyncio.run(load())]
    if as_json:
        sys.stdout.write(json.dumps(rows, ensure_ascii=False, indent=2) + "\n")
        return
    table = Table(
        "connection",
        "platform",
        "status",
        "walk",
        "done/listed",
        "indexed",
        "failed",
        "skipped",
        "docs/s",
        "ETA",
        "last error",
    )
    for row in rows:
        done = row["unchanged"] + row["indexed"] + row["failed"]
        table.add_row(
            row["name"],
            row["platform"],
            row["status"] or "never synced",
            (row["direction"] or "") + (", resumed" if row["resumed"] else ""),
            f"{done}/{row['listed']}",
            str(row["indexed"]),
            str(row["failed"]),
            str(row["skipped"]),
            f"{row['rate']:.1f}" if row["rate"] is not None else "",
            f"{row['eta_seconds']:.0f} s" if row["eta_seconds"] is not None and row["status"] == "Syncing" else "",
            row["last_error"] or row["reason"] or "",
        )
    Console().print(table)


@credentials.command()
def rotate() -> None:
    """Re-encrypt every connection's credentials with the first key of RAGSTREAM_CREDENTIAL_KEYS.

    Put the new key first and keep the old ones, run this, then remove the old keys."""

    async def run(runtime: Runtime) -> int:
        store = ConnectionStore(runtime.pool, CredentialCipher.from_settings(runtime.settings))
        return await store.rotate_credentials()

    try:
        count = _run(run)
    except (CredentialKeyMissing, CredentialsUnreadable) as error:
        console.print(f"[red]{error}[/]", highlight=False)
        raise typer.Exit(1) from None
    typer.echo(f"{count} connection(s) re-encrypted with the primary key")


if __name__ == "__main__":
    app()
