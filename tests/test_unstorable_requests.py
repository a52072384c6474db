"""Text PostgreSQL cannot store (a NUL, a lone surrogate) in a request is the caller's error: 422 over
HTTP, INVALID_ARGUMENT over gRPC, never a database error."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from ragstream.api.connections import connections_router
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.core.storable import check_storable, strip_unstorable
from ragstream.credentials import CredentialCipher
from ragstream.retrieval.reader import DocumentReader
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc

pytestmark = pytest.mark.integration


async def ready() -> bool:
    return True


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    app = create_app(
        lambda: runtime.retriever,
        ready=ready,
        reader=lambda: reader,
        routers=[connections_router(ConnectionStore(runtime.pool, CredentialCipher([])))],
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as opened:
        yield opened


@pytest.mark.parametrize(
    ("text", "expected"),
    [("plain", "plain"), ("a\x00b", "ab"), ("lone \ud800 high", "lone  high"), ("中文 ok", "中文 ok")],
)
def test_unstorable_characters_are_stripped_or_refused(text: str, expected: str) -> None:
    assert strip_unstorable(text) == expected
    if text == expected:
        assert check_storable(text) == text
    else:
        with pytest.raises(ValueError, match="cannot be stored"):
            check_storable(text)


@pytest.mark.parametrize(
    ("body", "where", "why"),
    [
        ({"query": "a\x00b"}, ["body", "query"], "cannot be stored"),
        ({"query": "lone \udc00"}, ["body", "query"], "unicode string"),
        ({"query": "q", "filters": {"sources": ["a\x00"]}}, ["body", "filters", "sources", 0], "cannot be stored"),
        ({"query": "q", "filters": {"sources": ["\ud800"]}}, ["body", "filters", "sources", 0], "lone surrogate"),
        (
            {"query": "q", "filters": {"metadata": {"team": "x\x00"}}},
            ["body", "filters", "metadata", "team"],
            "cannot be stored",
        ),
        ({"query": "q", "principal": {"user": "ceo\x00"}}, ["body", "principal", "user"], "cannot be stored"),
        (
            {"query": "q", "principal": {"user": "u", "groups": ["g\x00"]}},
            ["body", "principal", "groups", 0],
            "cannot be stored",
        ),
        ({"query": "q", "conversation_id": "c\x00"}, ["body", "conversation_id"], "cannot be stored"),
        (
            {"query": "q", "history": [{"role": "user", "content": "\x00"}]},
            ["body", "history", 0, "content"],
            "cannot be stored",
        ),
        (
            {"query": "q", "user_context": {"department": "sales\x00"}},
            ["body", "user_context", "department"],
            "cannot be stored",
        ),
        ({"query": "q", "user_context": {"dep\x00t": "sales"}}, ["body", "user_context"], "cannot be stored"),
        (
            {"query": "q", "user_context": {f"key{i}": "v" for i in range(21)}},
            ["body", "user_context"],
            "at most 20 items",
        ),
    ],
)
async def test_search_with_unstorable_text_is_422(
    client: httpx.AsyncClient, body: dict[str, Any], where: list[Any], why: str
) -> None:
    # Encoded here: httpx's own JSON encoding refuses a lone surrogate, which a JSON escape can carry.
    response = await client.post("/v1/search", content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 422
    problem = response.json()["detail"][0]
    # A union member adds its name after the field (the metadata value's str). A lone surrogate in a
    # field with a length limit fails pydantic's own string check first.
    assert problem["loc"][: len(where)] == where and why in problem["msg"]


async def test_the_same_requests_without_the_character_are_searched(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/search",
        json={"query": "ab", "filters": {"sources": ["a"]}, "principal": {"user": "ceo", "groups": ["g"]}},
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("/v1/documents/doc%00x", ["path", "document_id"]),
        ("/v1/documents/doc-x?user=ceo%00", ["query", "user"]),
        ("/v1/documents/doc-x?user=u&groups=board%00", ["query", "groups", 0]),
        ("/v1/documents/doc-x?conversation_id=c%00", ["query", "conversation_id"]),
    ],
)
async def test_document_reads_with_unstorable_text_are_422(
    client: httpx.AsyncClient, path: str, where: list[Any]
) -> None:
    response = await client.get(path)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == where
    assert (await client.get("/v1/documents/doc-x?user=u&groups=board")).status_code == 404


async def test_a_connection_name_with_a_nul_is_422(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/connections", json={"platform": "yuque", "name": "docs\x00"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "name"]


@pytest.mark.parametrize(
    ("message", "where"),
    [
        (retrieval_pb2.SearchRequest(query="a\x00b"), "query: Value error, contains a NUL character at position 1"),
        (
            retrieval_pb2.SearchRequest(query="q", principal=retrieval_pb2.Principal(user="ceo\x00")),
            "principal.user: Value error, contains a NUL character",
        ),
        (
            retrieval_pb2.SearchRequest(
                query="q", filters=retrieval_pb2.SearchFilters(sources=retrieval_pb2.StringList(values=["\x00"]))
            ),
            "filters.sources.0: Value error",
        ),
    ],
)
async def test_grpc_search_with_a_nul_is_invalid_argument(
    runtime: Runtime, message: retrieval_pb2.SearchRequest, where: str
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        port = await stack.enter_async_context(grpc_server(lambda: runtime.retriever, host="127.0.0.1", port=0))
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Search(message, timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert where in (raised.value.details() or "")
        await stub.Search(retrieval_pb2.SearchRequest(query="ab"), timeout=10)  # the same server answers
