"""Chat completions over an OpenAI-style route (DashScope's compatible mode by default): the one client
the rephraser and contextual retrieval share.

Usage:
    chat = ChatClient(api_key, model="qwen-plus")
    answer = await chat.complete([{"role": "user", "content": "…"}], max_tokens=100)
    await chat.aclose()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from ragstream.core.errors import ProviderError
from ragstream.embedding._http import ModelApiClient
from ragstream.embedding.base import EmbeddingError
from ragstream.embedding.openai_compatible import parse_openai_error
from ragstream.vendor_http import RetryPolicy

__all__ = ["CHAT_PATH", "DEFAULT_COMPATIBLE_BASE_URL", "ChatAnswer", "ChatClient", "ChatError"]

DEFAULT_COMPATIBLE_BASE_URL = "https://dashscope.aliyuncs.com/compatible-mode/v1"
CHAT_PATH = "/chat/completions"


class ChatError(ProviderError):
    """The chat model failed or answered nothing usable; the message never carries the key."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """The assistant's text of the first choice, and what identifies the request in the vendor's logs."""

    content: str
    request_id: object


class ChatClient:
    """``POST {base_url}/chat/completions`` with the remote embedders' retries, concurrency cap and key
    redaction (a platform's Retry-After honoured up to ``backoff_max_s``). Any server speaking that
    route (vLLM, Ollama) works with its own ``base_url``."""

    def __init__(
        self,
        api_key: str,
        model: str = "qwen-plus",
        base_url: str = DEFAULT_COMPATIBLE_BASE_URL,
        *,
        provider: str = "dashscope-chat",
        timeout_s: float = 8.0,
        max_retries: int = 1,
        max_concurrency: int = 4,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.model = model
        self._http = ModelApiClient(
            provider=provider,
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
            secrets=[api_key],
            parse_error=parse_openai_error,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            retry=RetryPolicy(max_retries, backoff_initial_s, backoff_max_s, max_wait_s=backoff_max_s),
            transport=transport,
        )

    async def complete(self, messages: list[dict[str, str]], *, max_tokens: int, json_mode: bool = False) -> ChatAnswer:
        """The model's answer at temperature 0; ``json_mode`` asks for one JSON object (the prompt must
        say JSON, as the vendors require)."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        if json_mode:
            payload["response_format"] = {"type": "json_object"}
        try:
            body = await self._http.post_json(CHAT_PATH, payload)
        except EmbeddingError as error:
            raise ChatError(str(error), retryable=error.retryable) from None
        request_id = body.get("request_id") or body.get("id")
        content = _content(body)
        if content is None:
            raise self.malformed("answer has no choices[0].message.content", request_id)
        return ChatAnswer(content, request_id)

    def malformed(self, reason: str, request_id: object) -> ChatError:
        """A 2xx answer that cannot be used: permanent, the same request gets the same answer."""
        return ChatError(str(self._http.malformed(reason, request_id)), retryable=False)

    async def aclose(self) -> None:
        await self._http.aclose()


def _content(body: dict[str, Any]) -> str | None:
    choices = body.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None
