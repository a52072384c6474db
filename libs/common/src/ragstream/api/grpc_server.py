"""gRPC API of the retriever (``ragstream.v1.Retrieval``, proto/ragstream/v1/retrieval.proto), with
gRPC health checking and server reflection.

The servicer only translates: a request message becomes the HTTP API's :class:`SearchRequest` (so the
limits and defaults are the same pydantic ones), the same ``HybridRetriever.search`` answers it, and
the :class:`SearchResponse` becomes the reply message. Scope, ACL and citations are therefore exactly
those of ``POST /v1/search``, and :class:`AccessInterceptor` applies the HTTP API's keys and roles:
the key goes in the ``authorization`` metadata (``Bearer SECRET``); health and reflection are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol, get_args

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError
from typing_extensions import override

from ragstream.admission import Overloaded, SearchAdmission, counted_search
from ragstream.api.auth import Access, Caller
from ragstream.api.knowledge import parse_knowledge_request
from ragstream.core.errors import InvalidInput, Unavailable
from ragstream.core.search import MetadataValue, SearchRequest, SearchResponse
from ragstream.knowledge.models import ErrorCode, KnowledgeError, KnowledgeResponse
from ragstream.knowledge.service import KnowledgeAction, KnowledgeService
from ragstream.metrics import SEARCH_LATENCY
from ragstream.settings import Role
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc

__all__ = [
    "MAX_BATCH",
    "OPEN_SERVICES",
    "SERVICE_NAME",
    "AccessInterceptor",
    "InvalidRequest",
    "RetrievalServicer",
    "Searcher",
    "grpc_server",
    "knowledge_request",
    "knowledge_response",
    "search_request",
    "search_response",
]

logger = logging.getLogger(__name__)

SERVICE_NAME = retrieval_pb2.DESCRIPTOR.services_by_name["Retrieval"].full_name
# 32 answers of at most 12,000 characters of text each (three bytes a CJK character) plus previews and
# ids stay well under the 4 MB a gRPC client accepts by default.
MAX_BATCH = 32

# Probes and API discovery: what a Kubernetes grpc probe or grpcurl needs without a key.
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})

_ROLES = {retrieval_pb2.ChatTurn.ROLE_USER: "user", retrieval_pb2.ChatTurn.ROLE_ASSISTANT: "assistant"}
_ListField = Literal["connection_ids", "platforms", "knowledge_bases", "sources"]
_LISTS: tuple[_ListField, ...] = get_args(_ListField)

Context = grpc.aio.ServicerContext[Any, Any]


class Searcher(Protocol):
    """What the servicer calls: ``HybridRetriever``, or a wrapper around one."""

    async def search(self, request: SearchRequest) -> SearchResponse: ...


class InvalidRequest(InvalidInput, ValueError):
    """A request message the HTTP API would answer with 422; the message says where and why, without
    echoing the input (it may be a long query or someone's history)."""


def _metadata_value(key: str, value: retrieval_pb2.MetadataValue) -> MetadataValue:
    kind = value.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(f"filters.metadata.{key}: no value set")
    result: MetadataValue = getattr(value, kind)
    return result


def _filters(filters: retrieval_pb2.SearchFilters) -> dict[str, Any]:
    return {
        **{name: list(getattr(filters, name).values) for name in _LISTS if filters.HasField(name)},
        "metadata": {key: _metadata_value(key, value) for key, value in filters.metadata.items()} or None,
    }


def _history(turns: Sequence[retrieval_pb2.ChatTurn]) -> list[dict[str, Any]]:
    # An unknown role becomes None, which the model rejects with the turn's position.
    return [{"role": _ROLES.get(turn.role), "content": turn.content} for turn in turns]


def search_request(message: retrieval_pb2.SearchRequest) -> SearchRequest:
    """The HTTP model of ``message``: unset optional fields stay unset, so the model's defaults apply.
    Raises :class:`InvalidRequest` when the model rejects it."""
    fields: dict[str, Any] = {
        "query": message.query,
        "filters": _filters(message.filters),
        "history": _history(message.history),
    }
    if message.HasField("top_k"):
        fields["top_k"] = message.top_k
    if message.HasField("conversation_id"):
        fields["conversation_id"] = message.conversation_id
    if message.HasField("principal"):
        fields["principal"] = {"user": message.principal.user, "groups": list(message.principal.groups)}
    if message.user_context:
        fields["user_context"] = dict(message.user_context)
    if message.HasField("rephrase"):
        fields["rephrase"] = message.rephrase
    try:
        return SearchRequest.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}" for problem in error.errors()
        )
        raise InvalidRequest(problems) from None


def search_response(response: SearchResponse) -> retrieval_pb2.SearchResponse:
    """The reply message of ``response``; ``None`` fields stay unset (the proto's optional fields)."""
    return retrieval_pb2.SearchResponse(
        query=response.query,
        rewritten_query=response.rewritten_query,
        results=[retrieval_pb2.SearchResult(**result.model_dump()) for result in response.results],
        reranked=response.reranked,
        embedding_space=response.embedding_space,
        embedding_spaces=response.embedding_spaces,
        degraded=[retrieval_pb2.DegradedPlatform(**entry.model_dump()) for entry in response.degraded],
        took_ms=response.took_ms,
        rephrase_outcome=response.rephrase_outcome,
        reply=response.reply,
    )


_KnowledgeField = Literal[
    "platform",
    "connection_id",
    "conversation_id",
    "query",
    "top_k",
    "document_id",
    "knowledge_base_id",
    "folder_id",
    "cursor",
    "limit",
    "knowledge_base",
    "title",
    "body",
    "shorten",
]
_KNOWLEDGE_OPTIONAL: tuple[_KnowledgeField, ...] = get_args(_KnowledgeField)


def knowledge_request(message: retrieval_pb2.KnowledgeRequest) -> KnowledgeAction:
    """The HTTP model of ``message`` (unset fields stay unset); :class:`InvalidRequest` when the
    model rejects it."""
    fields: dict[str, Any] = {"action": message.action}
    fields.update({name: getattr(message, name) for name in _KNOWLEDGE_OPTIONAL if message.HasField(name)})
    if message.HasField("principal"):
        fields["principal"] = {"user": message.principal.user, "groups": list(message.principal.groups)}
    if message.HasField("filters"):
        fields["filters"] = _filters(message.filters)
    if message.history:
        fields["history"] = _history(message.history)
    try:
        return parse_knowledge_request(fields)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None


def knowledge_response(response: KnowledgeResponse) -> retrieval_pb2.KnowledgeResponse:
    """The reply message of ``response``: its one outcome, and the hint."""
    message = retrieval_pb2.KnowledgeResponse(action=response.action, hint=response.hint)
    if response.search is not None:
        message.search.CopyFrom(search_response(response.search))
    if response.read is not None:
        read = response.read
        message.read.CopyFrom(
            retrieval_pb2.DocumentRead(**read.model_dump(exclude={"metadata"}), metadata_json=json.dumps(read.metadata))
        )
    if response.documents is not None:
        listing = response.documents
        message.documents.CopyFrom(
            retrieval_pb2.DocumentList(
                **listing.model_dump(exclude={"path", "entries"}),
                path=[retrieval_pb2.FolderRef(**step.model_dump()) for step in listing.path],
                entries=[retrieval_pb2.DocumentEntry(**entry.model_dump()) for entry in listing.entries],
            )
        )
    if response.written is not None:
        message.written.CopyFrom(retrieval_pb2.DocumentWritten(**response.written.model_dump()))
    if response.error is not None:
        message.error.CopyFrom(
            retrieval_pb2.KnowledgeError(code=response.error.code.value, message=response.error.message)
        )
    return message


def _knowledge_error(action: str, code: ErrorCode, message: str) -> retrieval_pb2.KnowledgeResponse:
    return knowledge_response(KnowledgeResponse(action=action, error=KnowledgeError(code=code, message=message)))


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServicer):
    """``Search`` and ``SearchBatch`` over the retriever that ``retriever`` returns (``None`` while the
    store is still opening: UNAVAILABLE, as the HTTP API's 503). With ``admission`` (the HTTP API's
    limiter), a call beyond it is RESOURCE_EXHAUSTED; a database without a free connection in time
    is UNAVAILABLE. Both carry ``grpc-retry-pushback-ms``, like the HTTP API's Retry-After."""

    def __init__(
        self,
        retriever: Callable[[], Searcher | None],
        admission: SearchAdmission | None = None,
        knowledge: Callable[[], KnowledgeService | None] | None = None,
    ) -> None:
        self._retriever = retriever
        self._admission = admission
        self._knowledge = knowledge

    @override
    async def Knowledge(
        self, request: retrieval_pb2.KnowledgeRequest, context: Context
    ) -> retrieval_pb2.KnowledgeResponse:
        """Every outcome in the answer (see the proto); only a passed deadline is a status."""
        try:
            parsed = knowledge_request(request)
        except InvalidRequest as error:
            return _knowledge_error(request.action[:40], ErrorCode.INVALID_REQUEST, str(error))
        service = self._knowledge() if self._knowledge is not None else None
        if service is None:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "1000"),))
            return _knowledge_error(parsed.action, ErrorCode.UNAVAILABLE, "the knowledge tool is not served yet")
        admission = self._admission if parsed.action == "search" else None
        deadline = asyncio.timeout(context.time_remaining())
        try:
            async with deadline, admission.admit() if admission is not None else contextlib.nullcontext():
                response = await service.handle(parsed)
        except Overloaded as error:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(error.retry_after_s * 1000)),))
            return _knowledge_error(parsed.action, ErrorCode.UNAVAILABLE, "too many searches at once")
        except TimeoutError:
            if not deadline.expired():
                raise
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the action finished")
        if response.error is not None and response.error.code is ErrorCode.UNAVAILABLE:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "1000"),))
        return knowledge_response(response)

    @override
    async def Search(self, request: retrieval_pb2.SearchRequest, context: Context) -> retrieval_pb2.SearchResponse:
        parsed = await self._parse([request], context)
        (response,) = await self._search(parsed, context)
        return search_response(response)

    @override
    async def SearchBatch(
        self, request: retrieval_pb2.SearchBatchRequest, context: Context
    ) -> retrieval_pb2.SearchBatchResponse:
        if len(request.requests) > MAX_BATCH:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_BATCH} requests per batch, got {len(request.requests)}"
            )
        parsed = await self._parse(request.requests, context, batch=True)
        responses = await self._search(parsed, context)
        return retrieval_pb2.SearchBatchResponse(responses=[search_response(response) for response in responses])

    @staticmethod
    async def _parse(
        messages: Sequence[retrieval_pb2.SearchRequest], context: Context, *, batch: bool = False
    ) -> list[SearchRequest]:
        parsed: list[SearchRequest] = []
        for index, message in enumerate(messages):
            try:
                parsed.append(search_request(message))
            except InvalidRequest as error:
                where = f"requests[{index}]: " if batch else ""
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}{error}")
        return parsed

    async def _search(self, requests: list[SearchRequest], context: Context) -> list[SearchResponse]:
        retriever = self._retriever()
        if retriever is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the index is still starting")
        # grpc.aio cancels a handler whose deadline passed; the timeout makes the search stop at the
        # deadline even where that cancellation comes late, and answers with the proper status.
        remaining: float | None = context.time_remaining()
        deadline = asyncio.timeout(remaining)
        admission = self._admission
        responses: list[SearchResponse] = []
        try:
            # A batch takes one turn: its searches run one after the other.
            with counted_search("grpc"):
                async with deadline, admission.admit() if admission is not None else contextlib.nullcontext():
                    for request in requests:
                        with SEARCH_LATENCY.time():
                            responses.append(await retriever.search(request))
        except Exception as error:
            if isinstance(error, TimeoutError) and deadline.expired():
                failure = (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the search finished")
            elif isinstance(error, Unavailable):  # the database busy or restarting, or no turn for the search
                context.set_trailing_metadata((("grpc-retry-pushback-ms", str(error.retry_after_s * 1000)),))
                refused = isinstance(error, Overloaded)
                failure = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED if refused else grpc.StatusCode.UNAVAILABLE,
                    error.public_reason,
                )
            else:  # a timeout of the search's own (a database call) is a failure like any other
                # The caller learns that it failed, not how: the log has the traceback.
                logger.exception("gRPC search failed")
                failure = (grpc.StatusCode.INTERNAL, "search failed")
        else:
            return responses
        # Outside the handlers above: abort() raises, and must not be caught as a search failure.
        await context.abort(*failure)


def _asserts_principal(message: object) -> bool:
    if isinstance(message, (retrieval_pb2.SearchRequest, retrieval_pb2.KnowledgeRequest)):
        return message.HasField("principal")
    if isinstance(message, retrieval_pb2.SearchBatchRequest):
        return any(request.HasField("principal") for request in message.requests)
    return False


def _denial(code: grpc.StatusCode, detail: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def deny(request: object, context: Context) -> None:
        await context.abort(code, detail)

    return grpc.unary_unary_rpc_method_handler(deny)


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a valid key, PERMISSION_DENIED for a role that may not call the method
    (Retrieval takes a search key; any other service, admin) or an admin key asserting a principal."""

    def __init__(self, access: Access) -> None:
        self._access = access

    @override
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        service = handler_call_details.method.strip("/").partition("/")[0]
        if service in OPEN_SERVICES:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        caller = self._access.authenticate(authorization if isinstance(authorization, str) else None)
        if caller is None:
            return _denial(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        if not caller.may_call(Role.SEARCH if service == SERVICE_NAME else Role.ADMIN):
            return _denial(grpc.StatusCode.PERMISSION_DENIED, "this API key may not call this method")
        handler = await continuation(handler_call_details)
        return handler if handler is None else _principal_checked(handler, caller)


def _principal_checked(handler: grpc.RpcMethodHandler[Any, Any], caller: Caller) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler``, refusing a request that asserts a principal when ``caller`` may not."""
    behaviour = handler.unary_unary
    if caller.may_assert_principal or behaviour is None:
        return handler

    async def checked(request: object, context: Context) -> object:
        if _asserts_principal(request):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "only a search key may assert a principal")
        return await behaviour(request, context)  # type: ignore[arg-type]  # the stubs know only sync contexts

    return grpc.unary_unary_rpc_method_handler(
        checked, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


async def _report_health(
    servicer: health.aio.HealthServicer, ready: Callable[[], Awaitable[bool]] | None, interval_s: float
) -> None:
    """Keep the health status of the server ("") and of the Retrieval service equal to ``ready()``
    (always SERVING without one), checked every ``interval_s`` seconds."""
    while True:
        try:
            serving = ready is None or await ready()
        except Exception:  # a readiness check that fails (database down) means not ready, not a crash
            serving = False
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await servicer.set(service, status)
        if ready is None:
            return
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def grpc_server(
    retriever: Callable[[], Searcher | None],
    *,
    host: str,
    port: int,
    ready: Callable[[], Awaitable[bool]] | None = None,
    health_interval_s: float = 5.0,
    grace_s: float = 5.0,
    access: Access | None = None,
    max_receive_bytes: int = 1024 * 1024,
    admission: SearchAdmission | None = None,
    knowledge: Callable[[], KnowledgeService | None] | None = None,
) -> AsyncIterator[int]:
    """Serve the Retrieval service, health checking and reflection on ``host:port`` (port 0: a free
    one) until the block exits, and yield the bound port. A port that cannot be bound raises.

    Health (for the server "" and for ``ragstream.v1.Retrieval``) follows ``ready`` like the HTTP
    ``/readyz``, so a Kubernetes ``grpc`` readiness probe means the same; it is NOT_SERVING during the
    ``grace_s`` in which calls in flight may finish. Calls go through ``access`` (none: every call
    allowed), and a message over ``max_receive_bytes`` is refused (RESOURCE_EXHAUSTED). Searches take a
    turn from ``admission``, shared with the HTTP API. ``knowledge`` serves the knowledge tool (its
    getter answering None: every call ``unavailable``)."""
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would start and silently take
    # a share of the calls (another `ragstream up` with another store). Off, binding it fails instead.
    server = grpc.aio.server(
        interceptors=[AccessInterceptor(access or Access.open())],
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_receive_bytes)],
    )
    retrieval_pb2_grpc.add_RetrievalServicer_to_server(RetrievalServicer(retriever, admission, knowledge), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    await server.start()
    reporter = asyncio.create_task(_report_health(health_servicer, ready, health_interval_s))
    try:
        yield bound
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
