"""Optional query rephrasing: conversation history in, one standalone question out."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from ragstream.embedding._http import RemoteEmbeddingClient, RetryPolicy
from ragstream.embedding.base import EmbeddingError
from ragstream.embedding.openai_compatible import parse_openai_error
from ragstream.retrieval.models import ChatTurn

__all__ = [
    "CHAT_PATH",
    "DEFAULT_COMPATIBLE_BASE_URL",
    "SYSTEM_PROMPT",
    "DashScopeChatRephraser",
    "QueryRephraser",
    "RephraseError",
]

DEFAULT_COMPATIBLE_BASE_URL = "https://dashscope.aliyuncs.com/compatible-mode/v1"
CHAT_PATH = "/chat/completions"

SYSTEM_PROMPT = (
    "You turn the last question of a conversation into one standalone search question.\n"
    "The user message is a JSON object: `history` holds the earlier turns, oldest first, and "
    "`question` the latest user message.\n"
    "Rewrite `question` so that it can be understood without the history: resolve pronouns, "
    "ellipses and references such as 'it', 'that one' or 'and for X?' using the history. Keep every "
    "name, number and term from the question. If it already stands on its own, return it unchanged.\n"
    "Write in the language of `question`. Do not answer it, do not explain, do not add quotes: reply "
    "with the one question only."
)

#: Only the recent turns resolve a follow-up; older ones cost tokens and latency for nothing.
MAX_HISTORY_TURNS = 6
MAX_TURN_CHARS = 2000

_PROVIDER = "dashscope-chat"
_QUOTES = {'"': '"', "'": "'", "“": "”", "「": "」", "『": "』", "«": "»"}


class QueryRephraser(Protocol):
    async def rephrase(self, query: str, history: Sequence[ChatTurn]) -> str: ...

    async def aclose(self) -> None: ...


class RephraseError(Exception):
    """The chat model failed or answered nothing usable; the message never carries the key."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class DashScopeChatRephraser:
    """Rephrases through an OpenAI-style ``POST {base_url}/chat/completions``.

    The default is DashScope's compatible mode, but any server speaking that route (vLLM, Ollama)
    works with its own ``base_url``. The conversation goes into one user message as JSON rather
    than as chat turns: the model then edits text instead of continuing a chat (where it tends to
    answer the follow-up), and a turn cannot pose as another role. Errors raise ``RephraseError``;
    the retriever then searches the raw question.
    """

    def __init__(
        self,
        api_key: str,
        model: str = "qwen-plus",
        base_url: str = DEFAULT_COMPATIBLE_BASE_URL,
        timeout_s: float = 8.0,
        max_retries: int = 1,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        max_tokens: int = 200,
        max_concurrency: int = 4,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 1.0,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._model = model
        self._max_tokens = max_tokens
        # The embedders' client is reused for its retries, pacing and key redaction.
        self._http = RemoteEmbeddingClient(
            provider=_PROVIDER,
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
            secrets=[api_key],
            parse_error=parse_openai_error,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            retry=RetryPolicy(max_retries, backoff_initial_s, backoff_max_s),
            transport=transport,
        )

    def messages(self, query: str, history: Sequence[ChatTurn]) -> list[dict[str, str]]:
        """The chat messages sent for ``query``; public so tests and logs can show the prompt."""
        turns = [{"role": turn.role, "content": turn.content[:MAX_TURN_CHARS]} for turn in history[-MAX_HISTORY_TURNS:]]
        # ensure_ascii=False: escaped CJK would cost several tokens per character.
        conversation = json.dumps({"history": turns, "question": query}, ensure_ascii=False)
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": conversation}]

    async def rephrase(self, query: str, history: Sequence[ChatTurn]) -> str:
        payload: dict[str, Any] = {
            "model": self._model,
            "messages": self.messages(query, history),
            "temperature": 0,
            "max_tokens": self._max_tokens,
        }
        try:
            body = await self._http.post_json(CHAT_PATH, payload)
        except EmbeddingError as error:
            raise RephraseError(str(error), retryable=error.retryable) from None
        content = _content(body)
        if content is None:
            raise self._malformed("answer has no choices[0].message.content", body)
        question = _unquote(content.strip())
        if not question:
            raise self._malformed("answer is empty", body)
        return question

    def _malformed(self, reason: str, body: dict[str, Any]) -> RephraseError:
        error = self._http.malformed(reason, body.get("request_id") or body.get("id"))
        return RephraseError(str(error), retryable=False)

    async def aclose(self) -> None:
        await self._http.aclose()


def _content(body: dict[str, Any]) -> str | None:
    choices = body.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


def _unquote(text: str) -> str:
    """Drop one pair of quotes around the whole answer, which models add despite being told not to."""
    if len(text) >= 2 and _QUOTES.get(text[0]) == text[-1]:
        return text[1:-1].strip()
    return text
