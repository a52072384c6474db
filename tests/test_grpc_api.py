"""The gRPC API (ragstream.v1.Retrieval) over a real grpc.aio channel and a real PostgreSQL: the same
answers as ``POST /v1/search``, the same filters and ACL, stable citations, status codes, deadlines,
health and reflection; and generated code that matches proto/."""

from __future__ import annotations

import asyncio
import contextlib
import filecmp
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from pydantic import BaseModel

from ragstream.api.grpc_server import (
    MAX_BATCH,
    SERVICE_NAME,
    Searcher,
    grpc_server,
    search_request,
    search_response,
)
from ragstream.api.http import create_app
from ragstream.connectors.folder import FolderConnector
from ragstream.retrieval import ChatTurn, Principal, SearchFilters, SearchRequest, SearchResponse, SearchResult
from ragstream.runtime import Runtime
from ragstream.storage.documents import document_id
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.support.grpc_client import result_dict

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]

DOCUMENTS = {
    "en/leave.md": "# Leave policy\n\n## Annual leave\n\nEvery employee gets 25 days of annual leave a year. "
    "Unused leave days carry over until March.\n",
    "en/expenses.md": "# Travel expenses\n\n## Hotels\n\nHotel costs up to 150 euros a night are reimbursed "
    "with a receipt. Book through the travel desk.\n",
    "en/salaries.md": "# Salary bands\n\n## Engineering\n\nThe salary band of a senior engineer is reviewed every "
    "April by the finance team.\n",
    "zh/qingjia.md": "# 请假制度\n\n## 年假\n\n员工每年享有十五天带薪年假，未休年假可顺延至次年三月。\n",
    "zh/chailv.md": "# 差旅标准\n\n## 住宿\n\n出差住宿标准为每晚五百元，凭发票报销。\n",
}
# Only alice and the finance group may see this one.
SALARIES_ACL = ["user:alice", "group:finance"]


async def ready() -> bool:
    return True


@dataclass(frozen=True)
class Indexed:
    connection_id: str
    salaries: str  # document id of the restricted document


@pytest.fixture
async def indexed(runtime: Runtime, corpus: Path) -> Indexed:
    for name, text in DOCUMENTS.items():
        (corpus / name).parent.mkdir(exist_ok=True)
        (corpus / name).write_text(text)
    connector = FolderConnector(corpus)
    assert (await runtime.pipeline().sync(connector)).ok
    salaries = document_id(connector.connection_id, "en/salaries.md")
    await runtime.store.update_acl(salaries, SALARIES_ACL)
    return Indexed(connector.connection_id, salaries)


@pytest.fixture
async def http(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(lambda: runtime.retriever, ready=ready)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


@dataclass(frozen=True)
class Served:
    stub: retrieval_pb2_grpc.RetrievalAsyncStub  # the async stub class is declared in the .pyi only
    channel: grpc.aio.Channel
    address: str


@contextlib.asynccontextmanager
async def serving(
    retriever: Callable[[], Searcher | None], ready: Callable[[], Any] | None = None
) -> AsyncIterator[Served]:
    """A gRPC server on a free port and a client channel to it."""
    async with grpc_server(retriever, host="127.0.0.1", port=0, ready=ready, health_interval_s=0.1) as port:
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as channel:
            yield Served(retrieval_pb2_grpc.RetrievalStub(channel), channel, address)


def message_of(request: SearchRequest) -> retrieval_pb2.SearchRequest:
    """The request as a gRPC client builds it, written independently of the server's conversion."""
    filters = request.filters
    lists = {
        name: retrieval_pb2.StringList(values=getattr(filters, name))
        for name in ("connection_ids", "platforms", "knowledge_bases", "sources")
        if getattr(filters, name) is not None
    }
    principal = request.principal
    return retrieval_pb2.SearchRequest(
        query=request.query,
        top_k=request.top_k,
        filters=retrieval_pb2.SearchFilters(**lists),
        principal=retrieval_pb2.Principal(user=principal.user, groups=principal.groups) if principal else None,
        conversation_id=request.conversation_id,
    )


def rest(response: retrieval_pb2.SearchResponse) -> dict[str, Any]:
    """The response fields besides the results and the timing."""
    return {
        "query": response.query,
        "rewritten_query": response.rewritten_query if response.HasField("rewritten_query") else None,
        "reranked": response.reranked,
        "embedding_space": response.embedding_space if response.HasField("embedding_space") else None,
    }


async def test_search_answers_as_the_http_api_with_filters_and_acl(
    runtime: Runtime, indexed: Indexed, http: httpx.AsyncClient
) -> None:
    scope = SearchFilters(connection_ids=[indexed.connection_id])
    salaries = "salary band of a senior engineer"
    requests = {
        "en": SearchRequest(query="how many days of annual leave", top_k=3, filters=scope),
        "zh": SearchRequest(query="出差住宿标准是多少", filters=scope),
        "anonymous": SearchRequest(query=salaries, filters=scope),
        "bob": SearchRequest(query=salaries, filters=scope, principal=Principal(user="bob", groups=["sales"])),
        "alice": SearchRequest(query=salaries, filters=scope, principal=Principal(user="alice")),
        "finance": SearchRequest(query=salaries, filters=scope, principal=Principal(user="carol", groups=["finance"])),
        "source": SearchRequest(
            query="年假", filters=SearchFilters(connection_ids=[indexed.connection_id], sources=["zh/qingjia.md"])
        ),
        "platform": SearchRequest(
            query="annual leave", filters=SearchFilters(connection_ids=[indexed.connection_id], platforms=["feishu"])
        ),
        "empty list": SearchRequest(query="annual leave", filters=SearchFilters(connection_ids=[])),
    }
    async with serving(lambda: runtime.retriever) as served:
        answers: dict[str, retrieval_pb2.SearchResponse] = {}
        for name, request in requests.items():
            expected = await http.post("/v1/search", json=request.model_dump(mode="json"))
            assert expected.status_code == 200, expected.text
            answer = await served.stub.Search(message_of(request), timeout=30)
            body = expected.json()
            assert [result_dict(result) for result in answer.results] == body["results"], name
            assert rest(answer) == {key: body[key] for key in rest(answer)}, name
            answers[name] = answer
        batch = await served.stub.SearchBatch(
            retrieval_pb2.SearchBatchRequest(requests=[message_of(request) for request in requests.values()]),
            timeout=60,
        )

    def sources(name: str) -> list[str]:
        return [result.source for result in answers[name].results]

    def documents(name: str) -> set[str]:
        return {result.document_id for result in answers[name].results}

    assert len(answers["en"].results) == 3 and sources("en")[0] == "en/leave.md"
    assert sources("zh")[0] == "zh/chailv.md"
    first = answers["zh"].results[0]
    assert (first.rank, first.citation_index, first.title, first.heading) == (1, 1, "差旅标准", "差旅标准")
    assert not first.HasField("url") and "五百元" in first.text and first.preview
    assert first.HasField("keyword_rank") and first.HasField("vector_rank")
    # The restricted document: never returned to who may not see it, first for who may.
    assert indexed.salaries not in documents("anonymous") | documents("bob")
    assert answers["anonymous"].results and answers["bob"].results  # the others still are
    assert answers["alice"].results[0].document_id == indexed.salaries
    assert answers["finance"].results[0].document_id == indexed.salaries
    assert set(sources("source")) == {"zh/qingjia.md"}
    assert not answers["platform"].results and not answers["empty list"].results
    assert [[result_dict(result) for result in response.results] for response in batch.responses] == [
        [result_dict(result) for result in answer.results] for answer in answers.values()
    ]


async def test_a_conversation_keeps_its_citation_numbers(runtime: Runtime, indexed: Indexed) -> None:
    def request(query: str, sources: list[str], conversation_id: str | None) -> retrieval_pb2.SearchRequest:
        return message_of(
            SearchRequest(
                query=query,
                filters=SearchFilters(connection_ids=[indexed.connection_id], sources=sources),
                conversation_id=conversation_id,
            )
        )

    conversation = f"conv-{uuid.uuid4().hex}"
    async with serving(lambda: runtime.retriever) as served:
        first = await served.stub.Search(request("hotel costs", ["en/expenses.md", "en/leave.md"], conversation))
        second = await served.stub.Search(request("annual leave", ["en/leave.md", "zh/chailv.md"], conversation))
        alone = await served.stub.Search(request("annual leave", ["en/leave.md", "zh/chailv.md"], None))
    numbers = {result.source: result.citation_index for result in first.results}
    assert numbers == {"en/expenses.md": 1, "en/leave.md": 2}
    again = {result.source: result.citation_index for result in second.results}
    assert again == {"en/leave.md": 2, "zh/chailv.md": 3}
    assert {result.source: result.citation_index for result in alone.results} == {"en/leave.md": 1, "zh/chailv.md": 2}


def invalid(**fields: Any) -> retrieval_pb2.SearchRequest:
    return retrieval_pb2.SearchRequest(**{"query": "annual leave", **fields})


@pytest.mark.parametrize(
    ("request_message", "where"),
    [
        (invalid(top_k=0), "top_k: Input should be greater than or equal to 1"),
        (invalid(top_k=31), "top_k: Input should be less than or equal to 30"),
        (invalid(query=""), "query: String should have at least 1 character"),
        (invalid(principal=retrieval_pb2.Principal(groups=["finance"])), "principal.user"),
        (invalid(history=[retrieval_pb2.ChatTurn(content="hi")]), "history.0.role"),
        (
            invalid(filters=retrieval_pb2.SearchFilters(metadata={"team": retrieval_pb2.MetadataValue()})),
            "filters.metadata.team: no value set",
        ),
    ],
)
async def test_invalid_requests_are_invalid_argument(
    runtime: Runtime, request_message: retrieval_pb2.SearchRequest, where: str
) -> None:
    async with serving(lambda: runtime.retriever) as served:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.stub.Search(request_message, timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert where in (raised.value.details() or "")
        # In a batch the index of the bad request is named; nothing is searched.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.stub.SearchBatch(
                retrieval_pb2.SearchBatchRequest(requests=[invalid(), request_message]), timeout=10
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (raised.value.details() or "").startswith(f"requests[1]: {where}")


async def test_a_batch_has_at_most_32_requests(runtime: Runtime) -> None:
    async with serving(lambda: runtime.retriever) as served:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.stub.SearchBatch(retrieval_pb2.SearchBatchRequest(requests=[invalid()] * (MAX_BATCH + 1)))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await served.stub.SearchBatch(retrieval_pb2.SearchBatchRequest(requests=[]))).responses == []


class SlowRetriever:
    """The real retriever behind a wait, as a slow search would be; records whether it was cancelled."""

    def __init__(self, inner: Searcher, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.cancelled = asyncio.Event()

    async def search(self, request: SearchRequest) -> SearchResponse:
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return await self.inner.search(request)


async def test_the_deadline_cancels_the_search(runtime: Runtime, indexed: Indexed) -> None:
    slow = SlowRetriever(runtime.retriever, delay_s=30)
    request = message_of(
        SearchRequest(query="annual leave", filters=SearchFilters(connection_ids=[indexed.connection_id]))
    )
    async with serving(lambda: slow) as served:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.stub.Search(request, timeout=0.5)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
        await asyncio.wait_for(slow.cancelled.wait(), 5)  # the server stopped searching too
        slow.delay_s = 0
        answer = await served.stub.Search(request, timeout=30)
    assert answer.results[0].source == "en/leave.md"


class BrokenRetriever:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def search(self, request: SearchRequest) -> SearchResponse:
        raise self.error


async def test_unavailable_until_the_store_is_open() -> None:
    async with serving(lambda: None) as served:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.stub.Search(invalid(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


# A timeout inside the search (not the caller's deadline) is a failure like any other.
@pytest.mark.parametrize(
    "error", [RuntimeError("connection to postgres://app:hunter2@db failed"), TimeoutError("hunter2")]
)
async def test_a_failed_search_is_internal_without_details(error: Exception) -> None:
    broken = BrokenRetriever(error)
    async with serving(lambda: broken) as served:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.stub.Search(invalid(), timeout=10)
        assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INTERNAL, "search failed")
        assert "hunter2" not in str(raised.value)


async def test_health_follows_readiness_and_reflection_lists_the_service(runtime: Runtime) -> None:
    state = {"ready": True}

    async def readiness() -> bool:
        return state["ready"]

    async with serving(lambda: runtime.retriever, readiness) as served:
        health = health_pb2_grpc.HealthStub(served.channel)
        for service in ("", SERVICE_NAME):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        state["ready"] = False
        deadline = time.monotonic() + 5
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != (
            health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "health did not follow readiness"
            await asyncio.sleep(0.05)

        def services() -> list[str]:
            # The reflection client needs a blocking channel: run it off the loop that serves.
            with grpc.insecure_channel(served.address) as blocking:
                return list(ProtoReflectionDescriptorDatabase(blocking).get_services())

        assert SERVICE_NAME in await asyncio.to_thread(services)


async def test_a_taken_port_fails_to_bind_instead_of_sharing_it() -> None:
    async with serving(lambda: None) as served:
        port = int(served.address.rsplit(":", 1)[1])
        with pytest.raises(RuntimeError, match="bind"):
            async with grpc_server(lambda: None, host="127.0.0.1", port=port):
                pass


def test_request_messages_become_the_http_models() -> None:
    message = retrieval_pb2.SearchRequest(
        query="年假 leave",
        filters=retrieval_pb2.SearchFilters(
            sources=retrieval_pb2.StringList(values=["a.md"]),
            platforms=retrieval_pb2.StringList(),
            metadata={
                "team": retrieval_pb2.MetadataValue(string_value="hr"),
                "year": retrieval_pb2.MetadataValue(int_value=2026),
                "weight": retrieval_pb2.MetadataValue(double_value=0.5),
                "public": retrieval_pb2.MetadataValue(bool_value=True),
            },
        ),
        principal=retrieval_pb2.Principal(user="alice", groups=["finance"]),
        history=[
            retrieval_pb2.ChatTurn(role=retrieval_pb2.ChatTurn.ROLE_USER, content="leave?"),
            retrieval_pb2.ChatTurn(role=retrieval_pb2.ChatTurn.ROLE_ASSISTANT, content="25 days"),
        ],
        user_context={"department": "sales"},
        rephrase=False,
    )
    expected = SearchRequest(
        query="年假 leave",
        filters=SearchFilters(
            sources=["a.md"], platforms=[], metadata={"team": "hr", "year": 2026, "weight": 0.5, "public": True}
        ),
        principal=Principal(user="alice", groups=["finance"]),
        history=[ChatTurn(role="user", content="leave?"), ChatTurn(role="assistant", content="25 days")],
        user_context={"department": "sales"},
        rephrase=False,
    )
    converted = search_request(message)
    assert converted == expected and converted.top_k == 10 and converted.conversation_id is None
    assert type(converted.filters.metadata["year"]) is int and converted.filters.metadata["public"] is True
    assert search_request(retrieval_pb2.SearchRequest(query="x")).filters == SearchFilters()
    assert search_request(retrieval_pb2.SearchRequest(query="x")).rephrase is True


def test_a_chitchat_reply_reaches_grpc_callers() -> None:
    reply = search_response(
        SearchResponse(query="hello", rephrase_outcome="chitchat", reply="Hi!", results=[], took_ms=1.0)
    )
    assert (reply.rephrase_outcome, reply.reply, list(reply.results)) == ("chitchat", "Hi!", [])
    searched = search_response(SearchResponse(query="q", results=[], took_ms=1.0))
    assert searched.rephrase_outcome == "original" and not searched.HasField("reply")


@pytest.mark.parametrize(
    ("message", "model"),
    [
        (retrieval_pb2.SearchRequest, SearchRequest),
        (retrieval_pb2.SearchFilters, SearchFilters),
        (retrieval_pb2.Principal, Principal),
        (retrieval_pb2.ChatTurn, ChatTurn),
        (retrieval_pb2.SearchResult, SearchResult),
        (retrieval_pb2.SearchResponse, SearchResponse),
    ],
)
def test_messages_have_the_fields_of_the_http_models(message: Any, model: type[BaseModel]) -> None:
    assert set(message.DESCRIPTOR.fields_by_name) == set(model.model_fields)


def test_checked_in_code_matches_the_proto(tmp_path: Path) -> None:
    """Fails when proto/ changed without ``make proto``, or the generated files were edited."""
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate_proto.py"), str(tmp_path)], check=True, capture_output=True
    )
    generated, checked_in = tmp_path / "ragstream" / "v1", REPO / "libs" / "common" / "src" / "ragstream" / "v1"
    names = sorted(path.name for path in generated.iterdir())
    assert names == sorted(path.name for path in checked_in.glob("*_pb2*"))
    _, mismatch, errors = filecmp.cmpfiles(generated, checked_in, names, shallow=False)
    assert (mismatch, errors) == ([], []), "stale generated code: run `make proto`"
