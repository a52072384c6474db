"""``POST /v1/knowledge``: the chat core's knowledge tool, one action per call.

A request that is understood and allowed is answered 200 with either its result or a structured
``error`` (``code``, ``message``): the tool never throws into the conversation. The exceptions are a
body that is not a valid request (422, ``invalid_request``) and a busy service (503 with
``Retry-After``, ``unavailable``), both in the same shape.

Auth: a ``search`` route, so the chat core's search key calls every action. ``create`` and ``update``
also need ``principal``, the user the expert writes for (who must be able to see the place written
to); since only a search key may assert a principal, an admin key cannot write through the tool.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from ragstream.admission import Overloaded, SearchAdmission
from ragstream.api.auth import check_principal, search_route
from ragstream.knowledge.models import ErrorCode, KnowledgeError, KnowledgeRequest, KnowledgeResponse
from ragstream.knowledge.service import KnowledgeAction, KnowledgeService

__all__ = ["knowledge_router", "parse_knowledge_request"]

_REQUEST: TypeAdapter[KnowledgeAction] = TypeAdapter(KnowledgeRequest)


def parse_knowledge_request(raw: bytes | str | dict[str, Any]) -> KnowledgeAction:
    """The request in ``raw`` (JSON, or its fields as gRPC gives them); ``ValueError`` says where and
    why it is not one (never echoing the input, which may be a whole document body)."""
    try:
        return _REQUEST.validate_python(raw) if isinstance(raw, dict) else _REQUEST.validate_json(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'body'}: {problem['msg']}"
            for problem in error.errors()
        )
        raise ValueError(problems) from None


def _action_of(raw: bytes) -> str:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        action = json.loads(raw).get("action")
        return action if isinstance(action, str) and len(action) <= 40 else ""
    return ""


def _error(
    action: str, code: ErrorCode, message: str, status: int, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = KnowledgeResponse(action=action, error=KnowledgeError(code=code, message=message))
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def knowledge_router(
    service: Callable[[], KnowledgeService | None], *, admission: SearchAdmission | None = None
) -> APIRouter:
    """``service`` is a getter: None while the store opens (503). ``admission`` is the search limiter,
    shared with ``/v1/search``: a knowledge search takes a turn like any search."""
    router = APIRouter(tags=["knowledge"])
    schema: dict[str, Any] = _REQUEST.json_schema()

    @router.post(
        "/v1/knowledge",
        response_model=KnowledgeResponse,
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}},
        responses={
            422: {"model": KnowledgeResponse, "description": "Not a valid request: error.code invalid_request"},
            503: {"model": KnowledgeResponse, "description": "Busy or starting: error.code unavailable"},
        },
    )
    @search_route
    async def knowledge(http: Request) -> JSONResponse:
        """One action of the knowledge tool: search, read, list_documents, create or update."""
        raw = await http.body()
        try:
            request = parse_knowledge_request(raw)
        except ValueError as error:
            return _error(_action_of(raw), ErrorCode.INVALID_REQUEST, str(error), 422)
        check_principal(http, request.principal is not None)
        current = service()
        if current is None:
            return _error(
                request.action, ErrorCode.UNAVAILABLE, "the index is still starting", 503, {"Retry-After": "1"}
            )
        turn = admission.admit() if admission is not None and request.action == "search" else contextlib.nullcontext()
        try:
            async with turn:
                response = await current.handle(request)
        except Overloaded as error:
            headers = {"Retry-After": str(error.retry_after_s)}
            return _error(request.action, ErrorCode.UNAVAILABLE, "too many searches at once", 503, headers)
        if response.error is not None and response.error.code is ErrorCode.UNAVAILABLE:
            return JSONResponse(response.model_dump(mode="json"), status_code=503, headers={"Retry-After": "1"})
        return JSONResponse(response.model_dump(mode="json"))

    return router
