"""Logging of every ragstream process: one stderr handler, text or JSON lines, with the ids of the work at hand.

Each entry point (the ``ragstream`` commands, the services' app factories) calls
:func:`configure_logging` once; calling it again replaces its handler rather than adding one.
Code that knows which connection, document or run it works on wraps that work in
:func:`log_context`; every record logged inside, by any logger, carries those ids::

    with log_context(connection_id=run.connection_id, run_id=run.id):
        await runner.execute(run)          # each record: connection_id=..., run_id=...

The text format shows them as ``[conn=… doc=… run=…]`` after the logger name; the JSON format
writes one object per line with ``time``, ``level``, ``logger``, ``message``, ``exception`` (when
there is one) and each id that is set. FastStream's records of a Kafka message (received, processed,
failed) add its ``topic``, ``group_id`` and ``message_id`` the same way. The context lives in a
:mod:`contextvars` variable, so each asyncio task sees the ids of the block it runs in, and tasks it
starts inherit them.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Protocol, TextIO, TypeVar

from ragstream.settings import LogSettings

__all__ = [
    "CONTEXT_FIELDS",
    "MESSAGE_FIELDS",
    "ContextFilter",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "current_context",
    "log_context",
    "with_document_log_context",
]

CONTEXT_FIELDS = ("connection_id", "document_id", "run_id")
"""The ids :func:`log_context` sets, as record attributes and JSON fields."""

MESSAGE_FIELDS = ("topic", "group_id", "message_id")
"""The Kafka message a FastStream record is about, when it says (its ``extra``)."""

_TEXT_LABELS = {
    "connection_id": "conn",
    "document_id": "doc",
    "run_id": "run",
    "topic": "topic",
    "group_id": "group",
    "message_id": "msg",
}
# Libraries that give their loggers handlers of their own, before the app is built.
_LIBRARY_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "faststream")
# They log every request's URL at INFO; a vendor's may carry a token in its query: only from DEBUG.
_REQUEST_LOGGERS = ("httpx", "httpcore")
_EMPTY: Mapping[str, str] = MappingProxyType({})
_context: ContextVar[Mapping[str, str]] = ContextVar("ragstream_log_context", default=_EMPTY)


@contextmanager
def log_context(
    *, connection_id: str | None = None, document_id: str | None = None, run_id: str | None = None
) -> Iterator[None]:
    """Put the given ids on every record logged inside the block; ids not given (None) keep the
    values of an enclosing block."""
    given = {"connection_id": connection_id, "document_id": document_id, "run_id": run_id}
    merged = {**_context.get(), **{name: value for name, value in given.items() if value is not None}}
    token = _context.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _context.reset(token)


class _DocumentIds(Protocol):
    @property
    def connection_id(self) -> str: ...

    @property
    def document_id(self) -> str: ...


class _DocumentMessage(Protocol):
    @property
    def header(self) -> _DocumentIds: ...


_Handler = TypeVar("_Handler")
_Message = TypeVar("_Message", bound=_DocumentMessage)
_Result = TypeVar("_Result")


def with_document_log_context(
    method: Callable[[_Handler, _Message], Awaitable[_Result]],
) -> Callable[[_Handler, _Message], Awaitable[_Result]]:
    """Decorate a stage's ``async def run(self, message)``: the call runs in a :func:`log_context`
    of the connection and document ids of ``message.header``."""

    @functools.wraps(method)
    async def run(handler: _Handler, message: _Message) -> _Result:
        header = message.header
        with log_context(connection_id=header.connection_id, document_id=header.document_id):
            return await method(handler, message)

    return run


def current_context() -> Mapping[str, str]:
    """The ids set by the enclosing :func:`log_context` blocks (empty outside any)."""
    return _context.get()


def _fields(record: logging.LogRecord) -> dict[str, str]:
    """The ids of :func:`log_context` and the message fields of ``record`` that are set, in order."""
    context = current_context()
    fields = {name: context[name] for name in CONTEXT_FIELDS if name in context}
    fields.update((name, str(value)) for name in MESSAGE_FIELDS if (value := getattr(record, name, None)))
    return fields


class ContextFilter(logging.Filter):
    """Sets ``ragstream_fields`` on the record (:func:`_fields`) and ``ragstream_context``, their
    ``[conn=… doc=…]`` text (empty when there are none). Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _fields(record)
        record.ragstream_fields = fields
        shown = " ".join(f"{_TEXT_LABELS[name]}={value}" for name, value in fields.items())
        record.ragstream_context = f" [{shown}]" if shown else ""
        return True


class TextFormatter(logging.Formatter):
    """Human lines: ``2026-12-02 12:00:00,123 WARNING ragstream.service [conn=… doc=…]: message``."""

    def __init__(self) -> None:
        line = "%(asctime)s %(levelname)s %(name)s%(ragstream_context)s: %(message)s"
        super().__init__(line, defaults={"ragstream_context": ""})  # a record the filter did not see


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    ``exception`` (the formatted traceback, when the record has one), each context id that is set and,
    for FastStream's records, the Kafka message's ``topic``, ``group_id`` and ``message_id``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        line.update(getattr(record, "ragstream_fields", {}))
        return json.dumps(line, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time of each record, so a stream swapped in
    later (a test runner's capture) is followed rather than written to after it closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # not setStream: that flushes the previous stream, which may be closed
        super().emit(record)


def configure_logging(settings: LogSettings | None = None) -> None:
    """Route every record to stderr in the format and from the level of ``settings`` (default: the
    environment's ``RAGSTREAM_LOG_*``), uvicorn's and FastStream's included. Idempotent: the handler
    of an earlier call is replaced, other handlers on the root logger are left alone."""
    settings = settings or LogSettings()
    root = logging.getLogger()
    for handler in [handler for handler in root.handlers if isinstance(handler, _StderrHandler)]:
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(settings.level)
    for name in _REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if settings.level == "DEBUG" else logging.WARNING)
    for name in _LIBRARY_LOGGERS:
        library_logger = logging.getLogger(name)
        library_logger.handlers.clear()
        library_logger.propagate = True
