"""Parsing in worker processes with a time and memory budget, so one bad document fails alone.

Each worker is ``python -m ragstream.parsing_pool``: a fresh interpreter (no fork of a process with
an event loop and threads), its address space capped with ``RLIMIT_AS``, that parses one document
at a time. It reads requests from its stdin and answers on its stdout, in frames of an 8-byte length
and a payload::

    ready     JSON {"ready": true}, once, when its imports are done (not part of any budget)
    request   JSON {"media_type", "title"}, then the content bytes
    reply     JSON {"title"} or {"code", "message"} (a ParseError), then the Markdown (UTF-8)

A worker over the wall-time budget is killed (``parse_timeout``); one out of memory answers
``parse_memory`` and exits, or, when the allocation failed in Rust code (the HTML converter), which
aborts the process instead of raising ``MemoryError``, dies after saying so on its stderr, which is
``parse_memory`` too; one that dies otherwise is ``parse_crashed``. The pool starts a new one in its
place on the next parse, and keeps the others warm.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import re
import resource
import struct
import sys
from typing import IO, Any

from ragstream.parsing import ParsedDocument, ParseError, ParseErrorCode, Parser

__all__ = ["ParserPool"]

_LENGTH = struct.Struct(">Q")
_CLOSE_GRACE_S = 5.0
_START_TIMEOUT_S = 60.0
# What Rust's default allocation error handler prints before it aborts the process.
_RUST_ALLOCATION_FAILED = re.compile(r"memory allocation of \d+ bytes failed")


class _Worker:
    """One worker process and the request/reply exchange over its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.out_of_memory = False
        assert process.stderr is not None  # a pipe
        self._stderr = asyncio.create_task(self._forward_stderr(process.stderr))

    async def _forward_stderr(self, stream: asyncio.StreamReader) -> None:
        """Copy the worker's stderr to ours, watching for what Rust says before it aborts the process
        on a failed allocation. Read in chunks, not lines: a library may write a line of any length."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        tail = ""  # the end of the previous chunk, for a message split between two
        while chunk := await stream.read(1 << 16):
            text = decoder.decode(chunk)
            sys.stderr.write(text)
            self.out_of_memory = self.out_of_memory or _RUST_ALLOCATION_FAILED.search(tail + text) is not None
            tail = text[-64:]

    @classmethod
    async def start(cls, parser: Parser, memory_mb: int) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ragstream.parsing_pool",
            "--max-bytes",
            str(parser.max_bytes),
            "--max-unpacked-bytes",
            str(parser.max_unpacked_bytes),
            "--memory-mb",
            str(memory_mb),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        worker = cls(process)
        assert process.stdout is not None
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                ready = json.loads(await _read_frame(process.stdout))
        except (asyncio.IncompleteReadError, TimeoutError) as error:
            status = await worker.kill()
            raise RuntimeError(f"a parser worker failed to start (exit status {status})") from error
        except BaseException:
            await worker.kill()
            raise
        if ready != {"ready": True}:
            await worker.kill()
            raise RuntimeError(f"a parser worker started with {ready!r} instead of its ready frame")
        return worker

    async def parse(self, content: bytes, media_type: str, title: str) -> ParsedDocument:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None  # both are pipes
        stdin.write(_frame(json.dumps({"media_type": media_type, "title": title}).encode()))
        stdin.write(_frame(content))
        await stdin.drain()
        reply: dict[str, Any] = json.loads(await _read_frame(stdout))
        markdown = (await _read_frame(stdout)).decode()
        if "code" in reply:
            raise ParseError(ParseErrorCode(reply["code"]), reply["message"])
        return ParsedDocument(reply["title"], markdown)

    async def kill(self) -> int:
        """Kill the process now; its exit status (negative: the signal)."""
        if self._process.returncode is None:
            self._process.kill()
        return await self._wait()

    async def _wait(self) -> int:
        """The exit status, once the process and the copy of its stderr have both ended."""
        status = await self._process.wait()
        # Shielded: a close that times out here must not cancel the copy, which kill then awaits.
        await asyncio.shield(self._stderr)
        return status

    async def close(self) -> None:
        """Let the process finish on the end of its input; kill it if it does not."""
        stdin = self._process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        try:
            async with asyncio.timeout(_CLOSE_GRACE_S):
                await self._wait()
        except TimeoutError:
            await self.kill()


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
    return await stream.readexactly(length)


class ParserPool:
    """``workers`` parser processes, each with ``memory_mb`` of address space and ``timeout_s`` per
    document; started on first use and kept warm until :meth:`aclose`.

    ``run`` waits for a free worker for at most ``10 × timeout_s`` (every parse ahead of it is bounded
    by ``timeout_s``), then raises ``TimeoutError``, which the stage retries as transient.
    """

    def __init__(self, parser: Parser, *, workers: int = 2, timeout_s: float = 60.0, memory_mb: int = 1024) -> None:
        if workers < 1:
            raise ValueError("a parser pool needs at least one worker")
        self._parser = parser
        self._timeout_s = timeout_s
        self._memory_mb = memory_mb
        # Last in, first out: a warm worker is taken before a slot whose worker has yet to start.
        self._idle: asyncio.LifoQueue[_Worker | None] = asyncio.LifoQueue()
        for _ in range(workers):
            self._idle.put_nowait(None)  # a free slot: its worker starts when first needed
        self._live: set[_Worker] = set()
        self._closed = False

    async def run(self, content: bytes, media_type: str, fallback_title: str) -> ParsedDocument:
        """The parsed document, or ``ParseError`` (with ``parse_timeout``, ``parse_memory`` and
        ``parse_crashed`` for a document the worker could not finish)."""
        if self._closed:
            raise RuntimeError("the parser pool is closed")
        self._parser.check_size(content)  # not worth piping to a worker
        try:
            async with asyncio.timeout(10 * self._timeout_s):
                worker = await self._idle.get()
        except TimeoutError:
            raise TimeoutError(f"no parser worker was free within {10 * self._timeout_s:.0f} s") from None
        try:
            if worker is None:
                worker = await _Worker.start(self._parser, self._memory_mb)
                self._live.add(worker)
            parsed = await self._parse(worker, content, media_type, fallback_title)
        except ParseError as error:
            if error.code in (ParseErrorCode.PARSE_MEMORY, ParseErrorCode.PARSE_TIMEOUT, ParseErrorCode.PARSE_CRASHED):
                await self._discard(worker)
                worker = None
            self._idle.put_nowait(worker)
            raise
        except BaseException:
            # Cancelled (or failed) mid-exchange: the worker's pipes are in an unknown state.
            await self._discard(worker)
            self._idle.put_nowait(None)
            raise
        self._idle.put_nowait(worker)
        return parsed

    async def _parse(self, worker: _Worker, content: bytes, media_type: str, title: str) -> ParsedDocument:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await worker.parse(content, media_type, title)
        except TimeoutError:
            raise ParseError(
                ParseErrorCode.PARSE_TIMEOUT, f"parsing took longer than {self._timeout_s:g} s; the worker was stopped"
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            status = await worker.kill()
            if self._closed:  # stopped by aclose, not by the document
                raise RuntimeError("the parser pool closed during the parse") from error
            if worker.out_of_memory:
                raise ParseError(
                    ParseErrorCode.PARSE_MEMORY, f"parsing needs more than {self._memory_mb} MB"
                ) from error
            raise ParseError(ParseErrorCode.PARSE_CRASHED, f"the parser process died (exit status {status})") from error

    async def _discard(self, worker: _Worker | None) -> None:
        if worker is not None:
            self._live.discard(worker)
            await worker.kill()

    async def aclose(self) -> None:
        """Stop every worker; parses still running fail."""
        self._closed = True
        live, self._live = self._live, set()
        await asyncio.gather(*(worker.close() for worker in live))


def _read_request(stream: IO[bytes]) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    payload = stream.read(length)
    return payload if len(payload) == length else None


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def _write_reply(stream: IO[bytes], reply: dict[str, str], markdown: str = "") -> None:
    stream.write(_frame(json.dumps(reply).encode()) + _frame(markdown.encode()))
    stream.flush()


def _serve(max_bytes: int, max_unpacked_bytes: int, memory_mb: int) -> None:
    """The worker's loop: parse requests until the end of stdin."""
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a library's stray print must not corrupt the replies
    # Imported now, not on the first document: the warm worker parses at once.
    import docx  # noqa: F401
    import html_to_markdown  # noqa: F401
    import pypdf  # noqa: F401

    parser = Parser(max_bytes, max_unpacked_bytes)
    replies.write(_frame(json.dumps({"ready": True}).encode()))
    replies.flush()
    while (header := _read_request(requests)) is not None and (content := _read_request(requests)) is not None:
        request = json.loads(header)
        try:
            parsed = parser.run(content, request["media_type"], request["title"])
        except ParseError as error:
            _write_reply(replies, {"code": error.code, "message": error.message})
            if error.code == ParseErrorCode.PARSE_MEMORY:
                return  # as below
        except MemoryError:
            del content
            _write_reply(
                replies, {"code": ParseErrorCode.PARSE_MEMORY, "message": f"parsing needs more than {memory_mb} MB"}
            )
            return  # a fresh worker replaces this one, whatever the failed allocation left behind
        except Exception as error:  # a parser bug on this input: it fails the same way on each attempt
            _write_reply(replies, {"code": ParseErrorCode.MALFORMED, "message": f"the parser failed: {error!r}"})
        else:
            _write_reply(replies, {"title": parsed.title}, parsed.markdown)


if __name__ == "__main__":
    arguments = argparse.ArgumentParser(description="A ragstream parser worker (started by ParserPool).")
    arguments.add_argument("--max-bytes", type=int, required=True)
    arguments.add_argument("--max-unpacked-bytes", type=int, required=True)
    arguments.add_argument("--memory-mb", type=int, required=True)
    options = arguments.parse_args()
    _serve(options.max_bytes, options.max_unpacked_bytes, options.memory_mb)
