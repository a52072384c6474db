"""A local DashScope stand-in (docs/platform-apis.md §6.5) served over real HTTP, with faults tests can inject.

Behaviour the vendor does not document is chosen here and labelled ASSUMPTION so a test never
mistakes it for a fact about the real service. Vectors come from hashed tokens: equal texts get
equal vectors and texts sharing words point the same way, which is enough for retrieval tests.

The chat route stands in for an LLM with one deterministic rewrite (see ``rewrite_follow_up``), enough
for query-rephrasing tests; it is no model of how a real LLM phrases anything.

Use the ``fake_dashscope`` fixture (register with ``pytest_plugins = ["tests.support.fake_dashscope"]``)
or ``run_fake_dashscope()`` as a context manager.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.support.http_server import serve_in_thread

__all__ = [
    "CHAT_PATH",
    "DEFAULT_API_KEY",
    "EMBEDDING_DIMENSIONS",
    "FakeDashScope",
    "Fault",
    "ReceivedRequest",
    "create_app",
    "fake_dashscope",
    "fake_dashscope_server",
    "fake_vector",
    "rewrite_follow_up",
    "run_fake_dashscope",
    "tokenize",
]

DEFAULT_API_KEY = "sk-fake-dashscope-0123456789abcdef"
NATIVE_EMBEDDING_PATH = "/api/v1/services/embeddings/text-embedding/text-embedding"
COMPATIBLE_EMBEDDING_PATH = "/compatible-mode/v1/embeddings"
RERANK_PATH = "/api/v1/services/rerank/text-rerank/text-rerank"
CHAT_PATH = "/compatible-mode/v1/chat/completions"

#: text-embedding-v3/v4 sizes on the current model page (§6.2); 1024 is the default.
EMBEDDING_DIMENSIONS = frozenset({1024, 768, 512, 256, 128, 64})
DEFAULT_DIMENSION = 1024
RERANK_MAX_DOCUMENTS = 500
RERANK_MAX_TOKENS_PER_ITEM = 4000

_TOKEN = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|[^\W_]+", re.UNICODE)


def tokenize(text: str) -> list[str]:
    """Lower-cased words, with each CJK character its own token (no segmenter needed)."""
    return _TOKEN.findall(text.lower())


@lru_cache(maxsize=65536)
def _hashed_unit(token: str, dimension: int) -> np.ndarray[Any, Any]:
    """Read-only, so the cached array cannot be changed by a caller."""
    seed = int.from_bytes(hashlib.sha256(token.encode()).digest()[:8], "big")
    vector = np.random.default_rng(seed).standard_normal(dimension)
    unit = vector / np.linalg.norm(vector)
    unit.flags.writeable = False
    return unit


def fake_vector(text: str, dimension: int = DEFAULT_DIMENSION) -> np.ndarray[Any, Any]:
    """The unit vector the fake returns for ``text``; tests compare against it.

    Sum of per-token hash vectors, so equal texts are equal and overlapping texts are close; a text
    without tokens hashes as a whole so it still gets a stable, non-zero vector.
    """
    tokens = tokenize(text) or [f"\x00{text}"]
    total = np.zeros(dimension)
    for token in tokens:
        total += _hashed_unit(token, dimension)
    norm = np.linalg.norm(total)
    return total / norm if norm else total


@dataclass(frozen=True)
class Fault:
    """One injected answer: an error (``status`` set) and/or a delay before answering."""

    status: int | None = None
    code: str = ""
    message: str = ""
    delay_s: float = 0.0
    retry_after: str | None = None


@dataclass(frozen=True)
class ReceivedRequest:
    """What reached the fake, for assertions on batch sizes and parameters."""

    path: str
    body: Any
    authorized: bool


@dataclass
class FakeDashScope:
    """State, knobs and counters of one fake server; ``base_url`` is set once it listens.

    Knobs may be set from the test thread between requests; counters are updated on the
    server's event loop under ``_lock``.
    """

    api_key: str = DEFAULT_API_KEY
    base_url: str = ""
    #: Texts per embedding request before 400 InvalidParameter (ASSUMPTION: real answer undocumented).
    batch_cap: int = 10
    #: Delay applied to every API request, e.g. to make concurrency observable.
    delay_s: float = 0.0
    #: Return embeddings in random list order; clients must key on text_index / index.
    shuffle: bool = False
    #: Scale vectors by a per-text factor so a client's unit-normalisation is observable.
    unnormalized: bool = False
    #: Compatible route quirk seen by one client (§6.2): every ``index`` is 0.
    duplicate_zero_index: bool = False
    #: ASSUMPTION, test-only: echo the presented key in the 401 message, as some OpenAI-style
    #: servers do, to check that clients redact it.
    echo_key_in_errors: bool = False
    #: Answer rerank requests with an ``index`` past the end of the documents, as a broken server might.
    rerank_out_of_range: bool = False
    #: Answer chat completions with this content verbatim instead of the deterministic rewrite.
    chat_content: str | None = None

    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    received: list[ReceivedRequest] = field(default_factory=list)
    faults: deque[Fault] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- knobs -------------------------------------------------------------------------------

    def fail_next(
        self,
        n: int = 1,
        *,
        status: int = 429,
        code: str = "Throttling.RateQuota",
        message: str = "Requests rate limit exceeded, please try again later.",
        retry_after: str | None = None,
    ) -> None:
        """Answer the next ``n`` API requests with this error (after auth), with a ``Retry-After``
        header when given (ASSUMPTION: the service's documentation does not say whether it sends one)."""
        with self._lock:
            self.faults.extend(Fault(status, code, message, retry_after=retry_after) for _ in range(n))

    def throttle_next(self, n: int = 1, *, status: int = 429, retry_after: str | None = None) -> None:
        """``Throttling.RateQuota`` with 429, or with 400 as one client observed (§6.4)."""
        self.fail_next(n, status=status, code="Throttling.RateQuota", retry_after=retry_after)

    def server_error_next(self, n: int = 1) -> None:
        self.fail_next(n, status=500, code="InternalError", message="An internal error has occured.")

    def delay_next(self, n: int, seconds: float) -> None:
        """Hold the next ``n`` requests for ``seconds`` before answering normally."""
        with self._lock:
            self.faults.extend(Fault(delay_s=seconds) for _ in range(n))

    def reset(self, idle_timeout_s: float = 5.0) -> None:
        """Clear knobs and counters, after waiting for requests abandoned by timed-out clients."""
        deadline = time.monotonic() + idle_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            self.batch_cap = 10
            self.delay_s = 0.0
            self.shuffle = self.unnormalized = self.duplicate_zero_index = False
            self.echo_key_in_errors = self.rerank_out_of_range = False
            self.chat_content = None
            self.requests = self.max_in_flight = 0
            self.received.clear()
            self.faults.clear()

    # -- views for assertions ----------------------------------------------------------------

    def expected_vectors(self, texts: list[str], dimension: int = DEFAULT_DIMENSION) -> np.ndarray[Any, Any]:
        """The unit vectors this fake answers for ``texts``, one row each."""
        return np.vstack([fake_vector(text, dimension) for text in texts])

    def bodies(self, path: str = NATIVE_EMBEDDING_PATH) -> list[Any]:
        return [r.body for r in self.received if r.path == path]

    # -- used by the app ---------------------------------------------------------------------

    def _enter(self, path: str, body: Any, authorized: bool) -> Fault | None:
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.received.append(ReceivedRequest(path, body, authorized))
            return self.faults.popleft() if authorized and self.faults else None

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _vector(self, text: str, dimension: int) -> list[float]:
        vector = fake_vector(text, dimension)
        if self.unnormalized:
            vector = vector * (1.0 + len(text) % 7)
        return list(vector.tolist())


_FOLLOW_UP = re.compile(r"^\s*(?:and|what about|how about)\s+(?:for\s+)?(?P<subject>.+?)\s*[?？]?\s*$", re.I)


def rewrite_follow_up(question: str, history: list[dict[str, Any]]) -> str:
    """The fake LLM's one skill: "And for X?" after "What is Y for Z?" becomes "What is Y for X?".

    Follow-ups starting with "and", "what about" or "how about" take the last earlier user question
    and replace what follows its last " for " (or append " for X"); anything else comes back as is.
    """
    match = _FOLLOW_UP.match(question)
    previous = next(
        (
            str(turn.get("content", "")).strip()
            for turn in reversed(history)
            if isinstance(turn, dict) and turn.get("role") == "user"
        ),
        "",
    )
    if not match or not previous:
        return question
    subject = match["subject"]
    head = previous.rstrip("?？ ")
    if " for " in head:
        head = head.rsplit(" for ", 1)[0]
    return f"{head} for {subject}?"


_GREETING = re.compile(r"^\s*(?:hi|hello|hey|thanks|thank you|good (?:morning|evening)|你好|谢谢|早上好)\b", re.I)
CHITCHAT_REPLY = "Hello! Ask me anything about your knowledge base."


def decide(question: str, history: list[dict[str, Any]], user_context: dict[str, Any]) -> dict[str, str]:
    """The fake LLM's decision in JSON mode, one deterministic rule per outcome: a greeting is
    chit-chat; "… policy" from a caller with a ``department`` in their context (and none in the
    question) is enriched with it; anything else is rephrased by ``rewrite_follow_up``."""
    if _GREETING.match(question):
        return {"outcome": "chitchat", "reply": CHITCHAT_REPLY}
    department = user_context.get("department")
    if isinstance(department, str) and "policy" in question.lower() and "department" not in question.lower():
        return {"outcome": "enrich", "question": f"{question.rstrip('?？ ')} of the {department} department?"}
    return {"outcome": "rephrase", "question": rewrite_follow_up(question, history)}


_CONTEXT_PROMPT = re.compile(r"<document>\n# (?P<title>[^\n]*)\n.*</document>.*<chunk>\n(?P<chunk>.*)\n</chunk>", re.S)


def situate(prompt: str) -> str | None:
    """The fake LLM's answer to a contextual-retrieval prompt: the document's title and the chunk's
    first line, or None when ``prompt`` is not one."""
    match = _CONTEXT_PROMPT.search(prompt)
    if match is None:
        return None
    return f"Part of the document {match['title']}, on {match['chunk'].splitlines()[0]}."


def _chat_conversation(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """The latest question, the turns before it and the caller's context, from either prompt shape.

    A last user message holding ``{"history": [...], "question": "...", "user_context": {...}}``
    (ragstream's rephraser) is read as such; otherwise the last user message is the question and the
    earlier user and assistant messages are the history.
    """
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    content = messages[last]["content"]
    try:
        packed: Any = json.loads(content)
    except ValueError:
        packed = None
    if isinstance(packed, dict) and isinstance(packed.get("question"), str) and isinstance(packed.get("history"), list):
        context = packed.get("user_context")
        return packed["question"], packed["history"], context if isinstance(context, dict) else {}
    return content, [m for m in messages[:last] if m["role"] in ("user", "assistant")], {}


def _request_id() -> str:
    return str(uuid.uuid4())


def _native_error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, "request_id": _request_id()}, status_code=status)


def _compatible_error(status: int, code: str, message: str) -> JSONResponse:
    # ASSUMPTION: OpenAI's error object plus DashScope's request_id at the top level.
    error = {"code": code, "message": message, "type": "invalid_request_error", "param": None}
    return JSONResponse({"error": error, "request_id": _request_id()}, status_code=status)


def _json_answer(content: dict[str, Any]) -> Response:
    """An embeddings answer serialised by orjson: ten 1,024-d vectors take well under a millisecond
    instead of the standard library's ~5 ms, CPU this stand-in would otherwise take from the client
    it serves on the same machine."""
    return Response(orjson.dumps(content), media_type="application/json")


def create_app(fake: FakeDashScope) -> FastAPI:
    """Build the ASGI app serving ``fake``'s behaviour."""
    app = FastAPI(title="fake DashScope")

    async def finish(arrived: float) -> None:
        """End a request ``delay_s`` after it arrived, the fake's own work included: a service's
        latency as its client sees it. Slept before the work, the work came on top: five answers
        computed one after another by this one process reached the client up to 9 ms late at 50 ms."""
        remaining = fake.delay_s - (time.perf_counter() - arrived)
        if remaining > 0:
            await asyncio.sleep(remaining)
        fake._leave()

    async def begin(request: Request, compatible: bool) -> tuple[Any, JSONResponse | None]:
        """Count the request, apply delays, auth and injected faults; return body or an error."""
        error = _compatible_error if compatible else _native_error
        try:
            body: Any = await request.json()
        except ValueError:
            body = None
        presented = request.headers.get("authorization", "")
        key = presented.removeprefix("Bearer ").strip() if presented.startswith("Bearer ") else ""
        authorized = key == fake.api_key
        fault = fake._enter(request.url.path, body, authorized)
        if fault and fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if not key:
            return body, error(401, "InvalidApiKey", "No API-key provided.")
        if not authorized:
            shown = f": {key}" if fake.echo_key_in_errors else "."
            code = "invalid_api_key" if compatible else "InvalidApiKey"
            return body, error(401, code, f"Invalid API-key provided{shown}")
        if fault and fault.status is not None:
            failed = error(fault.status, fault.code, fault.message)
            if fault.retry_after is not None:
                failed.headers["Retry-After"] = fault.retry_after
            return body, failed
        if not isinstance(body, dict):
            return body, error(400, "InvalidParameter", "Request body is not a JSON object.")
        if not body.get("model"):
            return body, error(400, "BadRequest.EmptyModel", "Required parameter(model) missing.")
        return body, None

    def check_texts(texts: Any, dimension: Any, compatible: bool) -> JSONResponse | None:
        error = _compatible_error if compatible else _native_error
        if texts is None or texts == [] or texts == "":
            return error(400, "BadRequest.EmptyInput", "Required input parameter missing.")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return error(400, "InvalidParameter", "Input should be a list of strings.")
        if len(texts) > fake.batch_cap:
            # ASSUMPTION: the real answer to an oversized batch is undocumented (§7.6).
            return error(
                400,
                "InvalidParameter",
                f"batch size is invalid, it should not be larger than {fake.batch_cap}.",
            )
        if dimension not in EMBEDDING_DIMENSIONS:
            return error(400, "InvalidParameter", f"Dimension {dimension!r} is not supported.")
        return None

    @app.post(NATIVE_EMBEDDING_PATH)
    async def native_embeddings(request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            body, failed = await begin(request, compatible=False)
            if failed:
                return failed
            raw_input = body.get("input")
            texts: Any = raw_input.get("texts") if isinstance(raw_input, dict) else None
            parameters = body.get("parameters") or {}
            dimension = parameters.get("dimension", DEFAULT_DIMENSION)
            if failed := check_texts(texts, dimension, compatible=False):
                return failed
            if parameters.get("text_type", "document") not in ("document", "query"):
                return _native_error(400, "InvalidParameter", "text_type is invalid.")
            if parameters.get("output_type", "dense") != "dense":
                # ASSUMPTION: sparse output is real but unused by ragstream; not modelled.
                return _native_error(400, "InvalidParameter", "fake supports output_type=dense.")
            items = [{"text_index": i, "embedding": fake._vector(text, dimension)} for i, text in enumerate(texts)]
            if fake.shuffle:
                random.shuffle(items)
            tokens = sum(len(tokenize(t)) for t in texts)
            return _json_answer(
                {
                    "request_id": _request_id(),
                    "output": {"embeddings": items},
                    "usage": {"total_tokens": tokens},
                }
            )
        finally:
            await finish(arrived)

    @app.post(COMPATIBLE_EMBEDDING_PATH)
    async def compatible_embeddings(request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            body, failed = await begin(request, compatible=True)
            if failed:
                return failed
            texts = body.get("input")
            if isinstance(texts, str) and texts:
                texts = [texts]
            dimension = body.get("dimensions", DEFAULT_DIMENSION)
            if failed := check_texts(texts, dimension, compatible=True):
                return failed
            if body.get("encoding_format", "float") != "float":
                return _compatible_error(400, "InvalidParameter", "fake supports float only.")
            data = [
                {
                    "object": "embedding",
                    "index": 0 if fake.duplicate_zero_index else i,
                    "embedding": fake._vector(text, dimension),
                }
                for i, text in enumerate(texts)
            ]
            if fake.shuffle:
                random.shuffle(data)
            tokens = sum(len(tokenize(t)) for t in texts)
            return _json_answer(
                {
                    "object": "list",
                    "data": data,
                    "model": body["model"],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                    "id": _request_id(),
                    "request_id": _request_id(),
                }
            )
        finally:
            await finish(arrived)

    @app.post(RERANK_PATH)
    async def rerank(request: Request) -> JSONResponse:
        arrived = time.perf_counter()
        try:
            body, failed = await begin(request, compatible=False)
            if failed:
                return failed
            raw_input = body.get("input")
            query = raw_input.get("query") if isinstance(raw_input, dict) else None
            documents = raw_input.get("documents") if isinstance(raw_input, dict) else None
            if not query or not documents:
                return _native_error(400, "BadRequest.EmptyInput", "query and documents required.")
            if not isinstance(query, str) or not isinstance(documents, list):
                return _native_error(400, "InvalidParameter", "query/documents have wrong types.")
            if not all(isinstance(d, str) for d in documents):
                return _native_error(400, "InvalidParameter", "documents must be strings.")
            if len(documents) > RERANK_MAX_DOCUMENTS:
                return _native_error(400, "InvalidParameter", f"at most {RERANK_MAX_DOCUMENTS} documents.")
            parameters = body.get("parameters") or {}
            top_n = parameters.get("top_n") or len(documents)
            if not isinstance(top_n, int) or top_n < 1:
                return _native_error(400, "InvalidParameter", "top_n must be a positive integer.")
            return_documents = bool(parameters.get("return_documents", False))
            # Items over the token limit are truncated, not rejected (§6.3).
            query_tokens = tokenize(query)[:RERANK_MAX_TOKENS_PER_ITEM]
            wanted = set(query_tokens)
            scored = []
            total_tokens = len(query_tokens)
            for index, document in enumerate(documents):
                doc_tokens = tokenize(document)[:RERANK_MAX_TOKENS_PER_ITEM]
                total_tokens += len(doc_tokens)
                overlap = len(wanted & set(doc_tokens)) / len(wanted) if wanted else 0.0
                scored.append((round(overlap, 6), index, document))
            scored.sort(key=lambda s: (-s[0], s[1]))
            results = []
            for score, index, document in scored[:top_n]:
                shown = len(documents) + index if fake.rerank_out_of_range else index
                result: dict[str, Any] = {"index": shown, "relevance_score": score}
                if return_documents:
                    result["document"] = {"text": document}
                results.append(result)
            return JSONResponse(
                {
                    "output": {"results": results},
                    "usage": {"total_tokens": total_tokens},
                    "request_id": _request_id(),
                }
            )
        finally:
            await finish(arrived)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> JSONResponse:
        arrived = time.perf_counter()
        try:
            body, failed = await begin(request, compatible=True)
            if failed:
                return failed
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _compatible_error(400, "InvalidParameter", "messages must be a non-empty list.")
            if not all(
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)
                for m in messages
            ):
                return _compatible_error(400, "InvalidParameter", "each message needs a role and a string content.")
            if not any(m["role"] == "user" for m in messages):
                return _compatible_error(400, "InvalidParameter", "messages need a user message.")
            json_mode = body.get("response_format") == {"type": "json_object"}
            if json_mode and not any("json" in m["content"].lower() for m in messages):
                # As the platform: JSON mode needs the prompt to ask for JSON.
                return _compatible_error(
                    400, "InvalidParameter", "'messages' must contain the word 'json' in some form."
                )
            question, history, user_context = _chat_conversation(messages)
            if fake.chat_content is not None:
                content = fake.chat_content
            elif json_mode:
                content = json.dumps(decide(question, history, user_context), ensure_ascii=False)
            else:
                content = situate(question) or rewrite_follow_up(question, history)
            prompt_tokens = sum(len(tokenize(m["content"])) for m in messages)
            completion_tokens = len(tokenize(content))
            return JSONResponse(
                {
                    "id": f"chatcmpl-{_request_id()}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    },
                }
            )
        finally:
            await finish(arrived)

    return app


@contextmanager
def run_fake_dashscope(api_key: str = DEFAULT_API_KEY, batch_cap: int = 10) -> Iterator[FakeDashScope]:
    """Serve a fresh fake on 127.0.0.1 in a background thread for the duration of the block."""
    fake = FakeDashScope(api_key=api_key, batch_cap=batch_cap)
    with serve_in_thread(create_app(fake), "fake-dashscope") as base_url:
        fake.base_url = base_url
        yield fake


@pytest.fixture(scope="session")
def fake_dashscope_server() -> Iterator[FakeDashScope]:
    """One server per test session: starting uvicorn per test would dominate the suite's time."""
    with run_fake_dashscope() as fake:
        yield fake


@pytest.fixture
def fake_dashscope(fake_dashscope_server: FakeDashScope) -> Iterator[FakeDashScope]:
    """The session's fake with knobs and counters reset, so tests cannot leak faults."""
    fake_dashscope_server.reset()
    yield fake_dashscope_server
    fake_dashscope_server.reset()
