"""Who may call the HTTP APIs, and how much a request may send.

Every request passes :class:`ApiGuard` and every endpoint :func:`authorize` (both installed by
:func:`protect`, which every app of the project calls), so a route is admin-only unless marked:
:data:`OPEN_PATHS` need no key, endpoints decorated with :func:`search_route` take a ``search`` key
too; a route added later, a mounted app or an unknown path needs admin. The principal rule (only a
``search`` key asserts who the user is) needs the parsed request, so those endpoints call
:func:`check_principal`. The gRPC API applies the same :class:`Access` in its interceptor.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragstream.core.errors import ConfigurationError
from ragstream.settings import ApiKeys, Role
from ragstream.telemetry import TracingMiddleware

if TYPE_CHECKING:
    from ragstream.settings import Settings

__all__ = [
    "OPEN_PATHS",
    "Access",
    "AccessSetupError",
    "ApiGuard",
    "Caller",
    "RequestBodyLimit",
    "authorize",
    "caller_of",
    "check_principal",
    "protect",
    "search_route",
]

logger = logging.getLogger(__name__)

# Probes, metrics and the API's description (the code
# is public, so its shape is no secret; the Swagger UI could not send a key for it anyway). Exact
# paths: /docs/x is not open.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"})

_ROLE_ATTRIBUTE = "__ragstream_role__"
_FORBIDDEN = "this API key may not call this route"
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])


class AccessSetupError(ConfigurationError, RuntimeError):
    """The settings do not allow serving as asked (no keys where they are required)."""


def search_route(endpoint: _Endpoint) -> _Endpoint:
    """Mark ``endpoint`` as callable with a ``search`` key (admin keys may call it too). Put it below the
    route decorator; an endpoint that takes a principal must also call :func:`check_principal`."""
    setattr(endpoint, _ROLE_ATTRIBUTE, Role.SEARCH)
    return endpoint


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its key's role, or ``None`` where no keys are configured (trusted
    local use, everything allowed)."""

    role: Role | None

    @property
    def may_assert_principal(self) -> bool:
        return self.role is None or self.role is Role.SEARCH

    def may_call(self, required: Role) -> bool:
        return self.role is None or self.role is Role.ADMIN or self.role is required


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class Access:
    """The API keys a process checks, or none (every call allowed)."""

    def __init__(self, keys: ApiKeys | None) -> None:
        self.keys = keys

    @classmethod
    def open(cls) -> Access:
        return cls(None)

    @property
    def enforced(self) -> bool:
        return self.keys is not None

    @classmethod
    def for_service(cls, settings: Settings, service: str) -> Access:
        """A service needs keys, unless ``RAGSTREAM_AUTH=none`` says the network authenticates."""
        if settings.api_keys is not None:
            return cls(settings.api_keys)
        if settings.auth == "none":
            logger.warning(
                "RAGSTREAM_AUTH=none: the %s service serves EVERY call WITHOUT authentication; callers may "
                "assert any principal. Only behind a proxy or mesh that authenticates.",
                service,
            )
            return cls.open()
        raise AccessSetupError(
            f"the {service} service needs RAGSTREAM_API_KEYS (ROLE:SECRET pairs, ROLE admin or search); "
            "set RAGSTREAM_AUTH=none only where a proxy or mesh authenticates every call"
        )

    @classmethod
    def for_embedded(cls, settings: Settings, host: str) -> Access:
        """``ragstream up``: keys when configured; without them, loopback only (trusted local use)."""
        if settings.api_keys is not None:
            return cls(settings.api_keys)
        if settings.auth != "none" and not _is_loopback(host):
            raise AccessSetupError(
                f"--host {host} would serve the network without authentication: set RAGSTREAM_API_KEYS "
                "(ROLE:SECRET pairs, ROLE admin or search), or serve 127.0.0.1"
            )
        return cls.open()

    def authenticate(self, authorization: str | None) -> Caller | None:
        """The caller presenting ``authorization`` (``Bearer SECRET``), or ``None`` when it does not
        name a configured key."""
        if self.keys is None:
            return Caller(None)
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        role = self.keys.role_of(token.strip())
        return Caller(role) if role is not None else None

    def describe(self) -> str:
        """One line for the start-up log; never a secret."""
        if self.keys is None:
            return (
                "no RAGSTREAM_API_KEYS: every call is allowed and callers may assert any principal "
                "(trusted local use, loopback only unless RAGSTREAM_AUTH=none)"
            )
        counts = {role: self.keys.roles().count(role) for role in Role}
        return "API keys required (" + ", ".join(f"{count} {role}" for role, count in counts.items()) + ")"


def _required_role(endpoint: object) -> Role:
    return Role(getattr(endpoint, _ROLE_ATTRIBUTE, Role.ADMIN))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class ApiGuard:
    """ASGI middleware: 401 (``WWW-Authenticate: Bearer``) without a valid key outside
    :data:`OPEN_PATHS`. The caller goes into the request state, where :func:`authorize` checks its
    role before a FastAPI endpoint runs; any other answer (a mounted app, an unknown path) that no
    role check let through becomes a 403 for a key that is not admin."""

    def __init__(self, app: ASGIApp, *, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        caller = self.access.authenticate(_header(scope, b"authorization"))
        state = scope.setdefault("state", {})
        state["caller"] = caller
        if scope["path"] in OPEN_PATHS:
            state["authorized"] = True
            await self.app(scope, receive, send)
            return
        if caller is None:
            await self._deny(scope, receive, send, 401, "missing or unknown API key")
            return
        state["authorized"] = caller.may_call(Role.ADMIN)
        if scope["type"] == "websocket":  # no websocket route takes a search key
            if not state["authorized"]:
                await self._deny(scope, receive, send, 403, _FORBIDDEN)
                return
            await self.app(scope, receive, send)
            return
        replaced = False

        async def checked_send(message: Message) -> None:
            nonlocal replaced
            # An answer before the role check (a body that does not parse, or over the limit) is let
            # through when the endpoint the router chose takes this caller's role.
            allowed = state["authorized"] or caller.may_call(_required_role(scope.get("endpoint")))
            if message["type"] == "http.response.start" and not allowed:
                replaced = True
                await self._deny(scope, receive, send, 403, _FORBIDDEN)
            elif not replaced:
                await send(message)

        await self.app(scope, receive, checked_send)

    @staticmethod
    async def _deny(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": detail})
            return
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse({"detail": detail}, status_code=status, headers=headers)(scope, receive, send)


def authorize(request: Request) -> None:
    """App-level dependency: 403 unless the caller's role may call the endpoint (admin, unless marked
    by :func:`search_route`). Runs before the endpoint, so a refused call has no effect."""
    if getattr(request.state, "authorized", False):  # an open path, or an admin key
        return
    if not caller_of(request).may_call(_required_role(request.scope.get("endpoint"))):
        raise HTTPException(status_code=403, detail=_FORBIDDEN)
    request.state.authorized = True


class _BodyTooLarge(HTTPException):
    """Raised from ``receive``: FastAPI passes an HTTPException from body reading on as it is."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body over {limit} bytes")


class RequestBodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, by ``Content-Length`` and by the bytes
    actually received (chunked bodies and lying lengths), before more than that is read."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        received = 0
        started = False

        async def limited_receive() -> Message:
            # Checked when the app reads, not up front: the route is chosen by then, so the role check
            # of ApiGuard knows the endpoint the body was meant for.
            nonlocal received
            if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
                raise _BodyTooLarge(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if started:  # an app that streams its answer while reading: nothing left to say
                raise
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body over {self.max_bytes} bytes"
        await JSONResponse({"detail": detail}, status_code=413, headers={"Connection": "close"})(scope, receive, send)


def protect(app: FastAPI, access: Access, *, max_request_bytes: int) -> None:
    """Put every route of ``app``, present and future, behind ``access`` and the body limit; call it
    before adding routes."""
    app.router.dependencies.append(Depends(authorize))
    # The last added middleware runs first: keys are checked before any body is read.
    app.add_middleware(RequestBodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(ApiGuard, access=access)
    # Outermost: a refused call is traced too (exported over OTLP when an endpoint is configured).
    app.add_middleware(TracingMiddleware)


def caller_of(request: Request) -> Caller:
    caller: Caller | None = getattr(request.state, "caller", None)
    if caller is None:  # an app built without protect(): refuse rather than trust
        raise HTTPException(
            status_code=401, detail="missing or unknown API key", headers={"WWW-Authenticate": "Bearer"}
        )
    return caller


def check_principal(request: Request, asserted: bool) -> None:
    """403 when the request asserts a principal and its key is not a ``search`` key: an admin key
    stands for an operator, not for a user whose permissions it could borrow."""
    if asserted and not caller_of(request).may_assert_principal:
        raise HTTPException(status_code=403, detail="only a search key may assert a principal")
