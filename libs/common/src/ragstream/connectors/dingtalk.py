"""DingTalk (钉钉) client: the app access token, dentry search and the blocks of an online document.

Vendor facts are in ``docs/platform-apis.md`` (DingTalk); where it is silent the choice is marked
ASSUMPTION here and in ``tests/support/fake_dingtalk.py``. DingTalk has no full-text export, so it is
searched live only (no connector syncs it).

- **Auth:** ``POST /v1.0/oauth2/accessToken`` ``{appKey, appSecret}`` gives ``{accessToken,
  expireIn}``; ``DingTalkToken`` (an ``httpx.Auth``) fetches it through the same client, keeps it
  until shortly before it expires, sends it as ``x-acs-dingtalk-access-token`` and fetches a new one
  once when a call answers 401. Every doc call carries ``operatorId``, the operator's unionId.
- **Search:** ``POST /v2.0/storage/dentries/search`` ``{keyword, option{maxResults, nextToken}}``:
  metadata only (``dentryUuid``, ``name``), paged until ``nextToken`` is missing or empty.
- **Content:** ``GET /v1.0/doc/suites/documents/{dentryUuid}/blocks``: only online ALIDOC documents
  have blocks; paragraphs and headings carry ``text``.
- **Errors:** 4xx with ``{code, message}``. ``LimitExceeded.Qps`` (HTTP status undocumented) and 5xx
  are transient; 401 and the token endpoint's refusals raise ``DingTalkAuthError``; others
  (``MissingoperatorId``, ``Forbidden.AccessDenied.*``, ``InvalidParameter``) ``DingTalkError``.

The app secret and the token never reach a message: server text is redacted and httpx errors are
never chained.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import SecretStr

from ragstream.vendor_http import RetryPolicy, Transient, VendorError, VendorHttp, json_body

__all__ = [
    "DINGTALK_BASE_URL",
    "TOKEN_HEADER",
    "DingTalkAuthError",
    "DingTalkClient",
    "DingTalkError",
    "DingTalkToken",
]

DINGTALK_BASE_URL = "https://api.dingtalk.com"
TOKEN_PATH = "/v1.0/oauth2/accessToken"
TOKEN_HEADER = "x-acs-dingtalk-access-token"
#: A token is renewed this long before its ``expireIn`` ends, so no call carries one that lapses in flight.
EXPIRY_MARGIN_S = 60.0
#: ASSUMPTION: the largest ``maxResults`` is undocumented; 50 per page.
MAX_PAGE = 50
QPS_CODE = "LimitExceeded.Qps"


class DingTalkError(VendorError):
    """What the platform answered (HTTP ``status``, its ``code``), without any secret."""


class DingTalkAuthError(DingTalkError):
    """The app key and secret were refused, or a fresh token was: nothing can be read."""


class DingTalkToken(httpx.Auth):
    """The app access token, fetched through the client it authenticates and cached until shortly
    before its ``expireIn``; concurrent requests share one fetch."""

    def __init__(
        self, app_key: SecretStr, app_secret: SecretStr, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._app_key = app_key
        self._app_secret = app_secret
        self._clock = clock
        self._token: str | None = None
        self._expires_at = 0.0
        self._lock = asyncio.Lock()

    def secrets(self) -> list[str]:
        return [self._app_secret.get_secret_value(), self._token or ""]

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        raise RuntimeError("DingTalkToken authenticates async clients only")

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        async with self._lock:
            if self._token is None or self._clock() >= self._expires_at:
                issued = yield self._token_request(request)
                await issued.aread()
                self._store(issued)
            token = self._token
        request.headers[TOKEN_HEADER] = token or ""
        response = yield request
        if response.status_code != 401:
            return
        async with self._lock:
            if self._token == token:  # nobody renewed it meanwhile
                issued = yield self._token_request(request)
                await issued.aread()
                self._store(issued)
            request.headers[TOKEN_HEADER] = self._token or ""
        yield request

    def _token_request(self, request: httpx.Request) -> httpx.Request:
        body = {"appKey": self._app_key.get_secret_value(), "appSecret": self._app_secret.get_secret_value()}
        return httpx.Request("POST", request.url.copy_with(raw_path=TOKEN_PATH.encode()), json=body)

    def _store(self, response: httpx.Response) -> None:
        body = json_body(response)
        token, expires_in = body.get("accessToken"), body.get("expireIn")
        if not response.is_success or not isinstance(token, str) or not token:
            code = body.get("code")
            message = body.get("message") if isinstance(body.get("message"), str) else response.reason_phrase
            text = f"{TOKEN_PATH}: HTTP {response.status_code}: {code or ''} {message}".strip()
            shown = text.replace(self._app_secret.get_secret_value(), "***")
            if response.status_code >= 500 or code == QPS_CODE:
                raise Transient(DingTalkError(shown, status=response.status_code, code=code, retryable=True))
            raise DingTalkAuthError(f"the DingTalk app credentials were refused ({shown})", retryable=False)
        lifetime = float(expires_in) if isinstance(expires_in, int | float) else 7200.0
        self._token = token
        self._expires_at = self._clock() + max(lifetime - EXPIRY_MARGIN_S, 0.0)


class DingTalkClient:
    """The calls a live search makes, for one app and one operator; the HTTP pool is opened on first
    use and closed by ``aclose``."""

    def __init__(
        self,
        app_key: SecretStr,
        app_secret: SecretStr,
        operator_union_id: str,
        *,
        base_url: str = DINGTALK_BASE_URL,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not (app_key.get_secret_value() and app_secret.get_secret_value() and operator_union_id):
            raise ValueError("a DingTalk client needs an app key, an app secret and an operator unionId")
        self._operator = operator_union_id
        self._auth = DingTalkToken(app_key, app_secret)
        self._http = VendorHttp(
            "dingtalk",
            base_url,
            timeout_s=timeout_s,
            retry=retry,
            transport=transport,
            secrets=self._auth.secrets,
            error_type=DingTalkError,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def search(self, keyword: str, wanted: int) -> AsyncIterator[dict[str, Any]]:
        """Dentries matching ``keyword``, at most ``wanted``, in the platform's order."""
        found = 0
        next_token = ""
        while found < wanted:
            option: dict[str, Any] = {"maxResults": min(wanted - found, MAX_PAGE)}
            if next_token:
                option["nextToken"] = next_token
            body = await self._call(
                "POST", "/v2.0/storage/dentries/search", json={"keyword": keyword, "option": option}
            )
            items = body.get("items")
            page = [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
            for item in page[: wanted - found]:
                yield item
            found += len(page)
            token = body.get("nextToken")
            if not page or not isinstance(token, str) or not token:
                return
            next_token = token

    async def blocks(self, dentry_uuid: str, *, end_index: int = 20) -> list[dict[str, Any]]:
        """The first blocks of an online (ALIDOC) document; other kinds answer an error."""
        path = f"/v1.0/doc/suites/documents/{quote(dentry_uuid, safe='')}/blocks"
        body = await self._call("GET", path, params={"startIndex": "0", "endIndex": str(end_index)})
        result = body.get("result")
        data = result.get("data") if isinstance(result, dict) else None
        return [block for block in data if isinstance(block, dict)] if isinstance(data, list) else []

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        params = {**kwargs.pop("params", {}), "operatorId": self._operator}

        async def once() -> dict[str, Any]:
            response = await self._http.send(method, path, params=params, auth=self._auth, **kwargs)
            if response.is_success:
                return json_body(response)
            raise self._failure(path, response)

        return await self._http.retrying(once, path)

    def _failure(self, path: str, response: httpx.Response) -> DingTalkError | Transient:
        status = response.status_code
        body = json_body(response)
        code = body.get("code") if isinstance(body.get("code"), str) else None
        message = body.get("message")
        shown = message if isinstance(message, str) and message else response.reason_phrase or "no message"
        text = self._http.redact(f"{path}: HTTP {status}: {code or '-'}: {shown}")
        if code == QPS_CODE or status == 429 or status >= 500:
            return Transient(DingTalkError(text, status=status, code=code, retryable=True))
        if status == 401:
            return DingTalkAuthError(
                f"the DingTalk token was refused ({text})", status=status, code=code, retryable=False
            )
        return DingTalkError(text, status=status, code=code, retryable=False)
