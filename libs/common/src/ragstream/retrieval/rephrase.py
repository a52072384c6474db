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

from ragstream.chat import CHAT_PATH, DEFAULT_COMPATIBLE_BASE_URL, ChatAnswer, ChatClient, ChatError
from ragstream.core.search import ChatTurn, RephraseOutcome

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


class RephraseError(ChatError):
    """The chat model failed or answered nothing usable; the message never carries the key."""


class DashScopeChatRephraser:
    """Rephrases through an OpenAI-style ``POST {base_url}/chat/completions`` (``ChatClient``).

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
        self._max_tokens = max_tokens
        self._chat = ChatClient(
            api_key,
            model,
            base_url,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_concurrency=max_concurrency,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
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
        # JSON mode: the answer is one object, not a question wrapped in prose or code fences.
        try:
            answer = await self._chat.complete(
                self.messages(query, history, user_context), max_tokens=self._max_tokens, json_mode=True
            )
        except ChatError as error:
            raise RephraseError(str(error), retryable=error.retryable) from None
        return self._decision(answer)

    def _decision(self, answer: ChatAnswer) -> Rephrasing:
        """The outcome the model chose. A model that ignores JSON mode and answers with the bare
        question (as older prompts asked) is read as a rephrase."""
        try:
            decided: Any = json.loads(answer.content)
        except ValueError:
            decided = None
        if not isinstance(decided, dict | list):
            question = _unquote(answer.content.strip())
            if not question:
                raise self._malformed("answer is empty", answer)
            return Rephrasing("rephrased", question)
        outcome = _OUTCOMES.get(str(decided.get("outcome"))) if isinstance(decided, dict) else None
        if outcome is None or not isinstance(decided, dict):
            raise self._malformed("answer names no known outcome", answer)
        field = "reply" if outcome == "chitchat" else "question"
        text = decided.get(field)
        if not isinstance(text, str) or not text.strip():
            raise self._malformed(f"a {outcome} answer has no {field}", answer)
        if outcome == "chitchat":
            return Rephrasing(outcome, "", reply=text.strip())
        return Rephrasing(outcome, _unquote(text.strip()))

    def _malformed(self, reason: str, answer: ChatAnswer) -> RephraseError:
        return RephraseError(str(self._chat.malformed(reason, answer.request_id)), retryable=False)

    async def aclose(self) -> None:
        await self._chat.aclose()


def _unquote(text: str) -> str:
    """Drop one pair of quotes around the whole answer, which models add despite being told not to."""
    if len(text) >= 2 and _QUOTES.get(text[0]) == text[-1]:
        return text[1:-1].strip()
    return text
