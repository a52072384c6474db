"""Logging: text or JSON lines on stderr, the ids of ``log_context`` on every record, one handler per process."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from ragstream.cli import app as cli
from ragstream.logs import (
    ContextFilter,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    current_context,
    log_context,
    with_document_log_context,
)
from ragstream.messages import DocumentChanged, DocumentHeader
from ragstream.service import create_service_app
from ragstream.settings import LogSettings, Settings

logger = logging.getLogger("ragstream.test_logs")


@pytest.fixture(autouse=True)
def root_logger() -> Iterator[logging.Logger]:
    """The root logger as each test found it, restored after: configuring logging is process-wide."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def ours(root: logging.Logger) -> list[logging.Handler]:
    """The handlers ``configure_logging`` installed (pytest keeps its own capture handlers beside them)."""
    return [handler for handler in root.handlers if any(isinstance(f, ContextFilter) for f in handler.filters)]


def json_lines(text: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_lines_carry_the_context_ids_inside_log_context_only(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format="json"))
    logging.getLogger("httpx").info("HTTP Request: GET https://vendor.example/?token=secret")  # only from DEBUG
    logger.info("before")
    with log_context(connection_id="conn-1", run_id="run-7"):
        with log_context(document_id="doc-3"):
            logger.warning("inside %s", "both")
        logger.info("connection only")
    logger.info("after")

    before, inside, connection_only, after = json_lines(capsys.readouterr().err)
    assert set(before) == {"time", "level", "logger", "message"}
    assert (before["level"], before["logger"], before["message"]) == ("INFO", "ragstream.test_logs", "before")
    assert inside["message"] == "inside both" and inside["level"] == "WARNING"
    assert (inside["connection_id"], inside["document_id"], inside["run_id"]) == ("conn-1", "doc-3", "run-7")
    assert connection_only["connection_id"] == "conn-1" and "document_id" not in connection_only
    assert set(after) == set(before)
    assert before["time"].endswith("+00:00")


def test_json_lines_carry_the_exception(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format="json"))
    try:
        raise ValueError("the cause")
    except ValueError:
        logger.exception("it failed")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["message"] == "it failed"
    assert "Traceback" in line["exception"] and "ValueError: the cause" in line["exception"]


def test_text_is_the_default_and_shows_the_ids(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAGSTREAM_LOG_FORMAT", raising=False)
    monkeypatch.setenv("RAGSTREAM_LOG_LEVEL", "warning")
    configure_logging()
    logger.info("below the level")
    with log_context(connection_id="conn-1", document_id="doc-3"):
        logger.warning("inside")
    logger.error("outside")

    inside, outside = capsys.readouterr().err.splitlines()
    assert inside.endswith(" WARNING ragstream.test_logs [conn=conn-1 doc=doc-3]: inside")
    assert outside.endswith(" ERROR ragstream.test_logs: outside")
    assert logging.getLogger().level == logging.WARNING


async def test_tasks_inherit_the_context_and_blocks_restore_it() -> None:
    seen: list[dict[str, str]] = []

    async def child() -> None:
        seen.append(dict(current_context()))

    with log_context(connection_id="conn-1"):
        await asyncio.create_task(child())
        with log_context(connection_id="conn-2", document_id=None):
            seen.append(dict(current_context()))
        seen.append(dict(current_context()))
    seen.append(dict(current_context()))
    assert seen == [{"connection_id": "conn-1"}, {"connection_id": "conn-2"}, {"connection_id": "conn-1"}, {}]


async def test_a_stage_run_logs_with_its_documents_ids() -> None:
    class Stage:
        @with_document_log_context
        async def run(self, message: DocumentChanged) -> dict[str, str]:
            return dict(current_context())

    header = DocumentHeader(
        document_id="doc-9",
        connection_id="conn-4",
        external_id="a.md",
        version=1,
        content_hash="h",
        title="A",
        source="a.md",
        media_type="text/markdown",
    )
    assert await Stage().run(DocumentChanged(header=header)) == {"connection_id": "conn-4", "document_id": "doc-9"}
    assert current_context() == {}


def test_the_cli_configures_logging_once_however_often_it_runs(
    root_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAGSTREAM_LOG_FORMAT", "json")
    runner = CliRunner()
    for _ in range(2):
        result = runner.invoke(cli, ["credentials", "--help"])
        assert result.exit_code == 0, result.output
    (handler,) = ours(root_logger)
    assert isinstance(handler.formatter, JsonFormatter)
    assert root_logger.level == logging.INFO


def test_a_service_factory_configures_logging_once(root_logger: logging.Logger) -> None:
    settings = Settings(logs=LogSettings(level="DEBUG", format="text"))
    for _ in range(2):
        create_service_app("chunker", lambda broker, options: None, settings=settings)
    (handler,) = ours(root_logger)
    assert isinstance(handler.formatter, TextFormatter)
    assert root_logger.level == logging.DEBUG


def test_uvicorn_records_go_through_the_same_handler(capsys: pytest.CaptureFixture[str]) -> None:
    uvicorn_logger = logging.getLogger("uvicorn.error")
    uvicorn_logger.addHandler(logging.StreamHandler())  # as uvicorn's own logging config leaves it
    configure_logging(LogSettings(format="json"))
    with log_context(connection_id="conn-1"):
        uvicorn_logger.warning("from uvicorn")
    (line,) = json_lines(capsys.readouterr().err)
    assert (line["logger"], line["message"], line["connection_id"]) == ("uvicorn.error", "from uvicorn", "conn-1")


def test_faststream_records_carry_the_kafka_message(capsys: pytest.CaptureFixture[str]) -> None:
    faststream_logger = logging.getLogger("faststream")
    faststream_logger.addHandler(logging.StreamHandler(sys.stdout))  # as FastStream leaves it at import
    faststream_logger.propagate = False
    configure_logging(LogSettings(format="json"))
    message = {"topic": "doc.changed", "group_id": "ragstream-chunker", "message_id": "4f2a9c"}
    with log_context(document_id="doc-3"):
        logging.getLogger("ragstream.kafka.messages").info("Received", extra=message)
    faststream_logger.info("FastStream app started")
    captured = capsys.readouterr()
    received, started = json_lines(captured.err)
    assert received == received | message | {"document_id": "doc-3", "message": "Received"}
    assert started["logger"] == "faststream" and "topic" not in started
    assert captured.out == ""

    configure_logging(LogSettings(format="text"))
    logging.getLogger("ragstream.kafka.messages").info("Processed", extra=message)
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith(" INFO ragstream.kafka.messages [topic=doc.changed group=ragstream-chunker msg=4f2a9c]: Processed")
    )
