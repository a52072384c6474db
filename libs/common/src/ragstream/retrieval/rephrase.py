"""Optional query rephrasing: the conversation, the question and the caller's context in; one of three
outcomes out (the product documents' rephraser):

* ``chitchat``: a greeting or a question the conversation itself answers gets a direct ``reply`` and no
  retrieval at all;
* ``rephrased``: a follow-up becomes one standalone question (pronouns and ellipses resolved);
* ``enriched``: a question too incomplete to search well is completed from the caller's user context
  (department, team, location), e.g. "the leave policy" becomes "the leave policy of the sales
  department".

Any failure (timeout, error, an answer that is not one of these) falls back to the raw question.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from ragstream.embedding._http import RemoteEmbeddingClient, RetryPolicy
from ragstream.embedding.base import EmbeddingError
from ragstream.embedding.openai_compatible import parse_openai_error
from ragstream.retrieval.models import ChatTurn, RephraseOutcome

__all__ = [
    "CHAT_PATH",
    "DEFAULT_COMPATIBLE_BASE_URL",
    "SYSTEM_PROMPT",
    "DashScopeChatRephraser",
    "QueryRephraser",
    "RephraseError",
    "RephraseOutcome",
    "Rephrasing",
]

DEFAULT_COMPATIBLE_BASE_URL = "https://dashscope.aliyuncs.com/compatible-mode/v1"
CHAT_PATH = "/chat/completions"

SYSTEM_PROMPT = (
    "You prepare the latest message of a conversation for a knowledge-base search.\n"
    "The user message is a JSON object: `history` holds the earlier turns, oldest first, `question` the "
    "latest user message, and `user_context` facts about the person asking (department, team, location; "
    "it may be empty).\n"
    "Decide exactly one of three outcomes and reply with one JSON object only:\n"
    '1. {"outcome": "chitchat", "reply": "..."}: `question` is a greeting, thanks or small talk, or the '
    "history already answers it; `reply` answers it briefly. Nothing is searched.\n"
    '2. {"outcome": "rephrase", "question": "..."}: rewrite `question` so that it can be understood '
    "without the history: resolve pronouns, ellipses and references such as 'it', 'that one' or 'and for "
    "X?'. Keep every name, number and term. If it already stands on its own, return it unchanged.\n"
    '3. {"outcome": "enrich", "question": "..."}: `question` is incomplete in a way `user_context` '
    "completes (for example 'the leave policy' from someone in sales becomes 'the leave policy of the "
    "sales department'); return the completed standalone question. Never add context that is not in "
    "`user_context`.\n"
    "Write the question or reply in the language of `question`. Do not answer a question you search for."
)

#: Only the recent turns resolve a follow-up; older ones cost tokens and latency for nothing.
MAX_HISTORY_TURNS = 6
MAX_TURN_CHARS = 2000

_PROVIDER = "dashscope-chat"
_QUOTES = {'"': '"', "'": "'", "“": "”", "「": "」", "『": "』", "«": "»"}

_OUTCOMES: dict[str, RephraseOutcome] = {"chitchat": "chitchat", "rephrase": "rephrased", "enrich": "enriched"}


@dataclass(frozen=True, slots=True)
class Rephrasing:
    """What the rephraser decided: the question to search, or for chit-chat the reply instead."""

    outcome: RephraseOutcome
    query: str
    reply: str | None = None

    @classmethod
    def original(cls, query: str) -> Rephrasing:
        return cls("original", query)


class QueryRephraser(Protocol):
    async def rephrase(
        self, query: str, history: Sequence[ChatTurn], user_context: Mapping[str, str] | None = None
    ) -> Rephrasing: ...

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

    def messages(
        self, query: str, history: Sequence[ChatTurn], user_context: Mapping[str, str] | None = None
    ) -> list[dict[str, str]]:
        """The chat messages sent for ``query``; public so tests and logs can show the prompt."""
        turns = [{"role": turn.role, "content": turn.content[:MAX_TURN_CHARS]} for turn in history[-MAX_HISTORY_TURNS:]]
        packed = {"history": turns, "question": query, "user_context": dict(user_context or {})}
        # ensure_ascii=False: escaped CJK would cost several tokens per character.
        conversation = json.dumps(packed, ensure_ascii=False)
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": conversation}]

    async def rephrase(
        self, query: str, history: Sequence[ChatTurn], user_context: Mapping[str, str] | None = None
    ) -> Rephrasing:
        payload: dict[str, Any] = {
            "model": self._model,
            "messages": self.messages(query, history, user_context),
            "temperature": 0,
            "max_tokens": self._max_tokens,
            # JSON mode: the answer is one object, not a question wrapped in prose or code fences.
            "response_format": {"type": "json_object"},
        }
        try:
            body = await self._http.post_json(CHAT_PATH, payload)
        except EmbeddingError as error:
            raise RephraseError(str(error), retryable=error.retryable) from None
        content = _content(body)
        if content is None:
            raise self._malformed("answer has no choices[0].message.content", body)
        return self._decision(content, body)

    def _decision(self, content: str, body: dict[str, Any]) -> Rephrasing:
        """The outcome the model chose. A model that ignores JSON mode and answers with the bare
        question (as older prompts asked) is read as a rephrase."""
        try:
            decided: Any = json.loads(content)
        except ValueError:
            decided = None
        if not isinstance(decided, dict | list):
            question = _unquote(content.strip())
            if not question:
                raise self._malformed("answer is empty", body)
            return Rephrasing("rephrased", question)
        outcome = _OUTCOMES.get(str(decided.get("outcome"))) if isinstance(decided, dict) else None
        if outcome is None or not isinstance(decided, dict):
            raise self._malformed("answer names no known outcome", body)
        field = "reply" if outcome == "chitchat" else "question"
        text = decided.get(field)
        if not isinstance(text, str) or not text.strip():
            raise self._malformed(f"a {outcome} answer has no {field}", body)
        if outcome == "chitchat":
            return Rephrasing(outcome, "", reply=text.strip())
        return Rephrasing(outcome, _unquote(text.strip()))

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
