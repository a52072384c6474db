"""API keys and roles on every HTTP route and gRPC method of every app, the principal rule, the
body limit, the start-up refusals, and a property test of zero leaks over keys, principals and
per-chunk ACLs on a real index."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.routing import BaseRoute, Mount, Route

from ragstream.api.auth import OPEN_PATHS, Access, AccessSetupError
from ragstream.api.grpc_server import grpc_server
from ragstream.api.http import create_app
from ragstream.embedded import api_app, serve
from ragstream.retrieval import Principal
from ragstream.retrieval.reader import DocumentReader
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import ApiKeys, Settings
from ragstream.storage.citations import CitationStore
from ragstream.storage.documents_read import DocumentReadStore
from ragstream.storage.runs import RunStore
from ragstream.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.support.connections import fetcher_database, private_database
from tests.support.runs import sync_runner
from tests.test_scope_acl import connection, index

pytestmark = pytest.mark.integration

ADMIN = "admin-key-" + "a" * 24
SEARCH = "search-key-" + "s" * 24
WRONG = "wrong-key-" + "w" * 24
KEYS = f"admin:{ADMIN},search:{SEARCH}"
ACCESS = Access(ApiKeys.parse(KEYS))
# The routes a search key may call; every other route that is not open must refuse it.
SEARCH_ROUTES = {("POST", "/v1/search"), ("GET", "/v1/documents/{document_id}"), ("POST", "/v1/knowledge")}
# The routes anyone may call: probes, metrics and the API's description; a longer list fails here.
OPEN = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"}


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


async def ready() -> bool:
    return True


def client_of(app: FastAPI) -> httpx.AsyncClient:
    # raise_app_exceptions off: an admin call into a service whose lifespan did not run may fail
    # inside the endpoint (500); what matters here is that it got past the check.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)


# --- the apps ---------------------------------------------------------------------------------------


@pytest.fixture
async def embedded(runtime: Runtime) -> AsyncIterator[FastAPI]:
    """The HTTP API of ``ragstream up``, with keys."""
    runs = RunStore(runtime.pool, runtime.dsn, stale_timeout_s=1800)
    runner = sync_runner(runs, runtime.pipeline, max_concurrent=1, progress_interval_s=1)
    try:
        yield api_app(runtime, runs, runner, access=ACCESS)
    finally:
        await runs.aclose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RetrieverService:
    app: FastAPI
    grpc_port: int


@pytest.fixture
async def retriever_service(database_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RetrieverService]:
    """The retriever service as uvicorn builds it, its lifespan run (store open, gRPC on loopback)."""
    from ragstream_retriever.main import create_app as create_retriever

    grpc_port = free_port()
    monkeypatch.setenv("RAGSTREAM_API_KEYS", KEYS)
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("RAGSTREAM_GRPC_HOST", "127.0.0.1")
    monkeypatch.setenv("RAGSTREAM_GRPC_PORT", str(grpc_port))
    app = create_retriever()
    async with app.router.lifespan_context(app):
        yield RetrieverService(app, grpc_port)


@pytest.fixture
async def fetcher_service(
    database_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[FastAPI]:
    """The connector-fetcher as uvicorn builds it, its lifespan run: the control plane joins then."""
    from ragstream_fetcher.main import create_app as create_fetcher

    async with fetcher_database(database_url, kafka_bootstrap, monkeypatch, scheduler_enabled="false"):
        monkeypatch.delenv("RAGSTREAM_AUTH")
        monkeypatch.setenv("RAGSTREAM_API_KEYS", KEYS)
        app = create_fetcher()
        async with app.router.lifespan_context(app):
            yield app


def routes_of(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path) of every route: those OpenAPI lists and those it does not (docs, mounts)."""
    found = {
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        for method in operations
        if method.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}
    }

    def add(routes: list[BaseRoute], prefix: str) -> None:
        for route in routes:
            if isinstance(route, Route):
                found.update((method, prefix + route.path) for method in route.methods or () if method != "HEAD")
            elif isinstance(route, Mount):
                found.add(("GET", prefix + route.path))
            elif (included := getattr(route, "original_router", None)) is not None:  # FastAPI's include_router
                add(included.routes, prefix + route.include_context.prefix)  # type: ignore[attr-defined]
            else:
                raise AssertionError(f"a route of a kind this test does not walk: {type(route)}")

    add(app.routes, "")
    return found


async def walk(app: FastAPI, expected_open: set[str]) -> None:
    routes = routes_of(app)
    assert expected_open == OPEN_PATHS
    assert {path for _, path in routes} >= expected_open
    async with client_of(app) as client:
        # Prometheus scrapes without a key.
        scraped = await client.get("/metrics")
        assert scraped.status_code == 200 and "# TYPE" in scraped.text
        for method, template in sorted(routes):
            path = re.sub(r"\{[^}]+\}", f"no-such-{uuid.uuid4().hex[:8]}", template)
            body = b"[" if method in {"POST", "PUT", "PATCH"} else None  # invalid JSON: 422, never an action

            async def call(key: str | None, method: str = method, path: str = path, body: bytes | None = body) -> int:
                headers = {**bearer(key), "content-type": "application/json"}
                return (await client.request(method, path, content=body, headers=headers)).status_code

            where = f"{method} {template}"
            if template in OPEN_PATHS:
                assert template in expected_open, f"{where} is open but not expected to be"
                assert await call(None) not in (401, 403), where
                continue
            anonymous = await client.request(method, path, content=body)
            assert anonymous.status_code == 401, where
            assert anonymous.headers["www-authenticate"] == "Bearer", where
            assert await call(WRONG) == 401, where
            searched = await call(SEARCH)
            if (method, template) in SEARCH_ROUTES:
                assert searched not in (401, 403) and searched < 500, where
            else:
                assert searched == 403, where
            assert await call(ADMIN) not in (401, 403), where


async def test_every_route_of_the_embedded_app_is_behind_the_keys(embedded: FastAPI) -> None:
    await walk(embedded, OPEN)


async def test_every_route_of_the_retriever_service_is_behind_the_keys(retriever_service: RetrieverService) -> None:
    await walk(retriever_service.app, OPEN)
    await grpc_keys_apply(retriever_service.grpc_port)


async def grpc_keys_apply(port: int) -> None:
    """The gRPC API on ``port`` answers a search key and refuses a call without one, the knowledge
    tool's included."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        request = retrieval_pb2.SearchRequest(query="kafka retention")
        assert await grpc_status(stub.Search(request)) == grpc.StatusCode.UNAUTHENTICATED
        authorized = stub.Search(request, metadata=[("authorization", f"Bearer {SEARCH}")])
        assert await grpc_status(authorized) == grpc.StatusCode.OK
        knowledge = retrieval_pb2.KnowledgeRequest(action="search", query="kafka retention")
        assert await grpc_status(stub.Knowledge(knowledge)) == grpc.StatusCode.UNAUTHENTICATED
        answered = await stub.Knowledge(knowledge, metadata=[("authorization", f"Bearer {SEARCH}")])
        assert answered.WhichOneof("outcome") == "search"
        writer = retrieval_pb2.KnowledgeRequest(
            action="create", platform="yuque", title="t", body="b", principal=retrieval_pb2.Principal(user="ceo")
        )
        refused = stub.Knowledge(writer, metadata=[("authorization", f"Bearer {ADMIN}")])
        assert await grpc_status(refused) == grpc.StatusCode.PERMISSION_DENIED


async def test_the_retriever_service_serves_the_knowledge_tool_without_writes(
    retriever_service: RetrieverService,
) -> None:
    async with client_of(retriever_service.app) as client:
        headers = bearer(SEARCH)
        found = await client.post("/v1/knowledge", json={"action": "search", "query": "kafka"}, headers=headers)
        assert found.status_code == 200 and found.json()["search"]["query"] == "kafka"
        create = {
            "action": "create",
            "platform": "yuque",
            "title": "Minutes",
            "body": "# Minutes\n\nAgreed.",
            "principal": {"user": "ceo"},
        }
        written = await client.post("/v1/knowledge", json=create, headers=headers)
        assert written.status_code == 200 and written.json()["error"]["code"] == "not_served_here"
        # An admin key is an operator's: it may not write for a user through the tool.
        assert (await client.post("/v1/knowledge", json=create, headers=bearer(ADMIN))).status_code == 403


async def test_ragstream_up_serves_both_apis_behind_the_keys(database_url: str) -> None:
    settings = Settings(database_url=database_url, scheduler_enabled=False)
    port, grpc_port = free_port(), free_port()
    async with private_database(database_url) as dsn, open_runtime(settings, dsn) as runtime:
        server = asyncio.create_task(serve(runtime, [], "127.0.0.1", port, 0, grpc_port=grpc_port, access=ACCESS))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for _ in range(600):
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get("/healthz")).status_code == 200:
                            break
                    await asyncio.sleep(0.05)
                assert (await client.get("/v1/connections")).status_code == 401
                assert (await client.get("/v1/connections", headers=bearer(SEARCH))).status_code == 403
                assert (await client.get("/v1/connections", headers=bearer(ADMIN))).json() == []
            await grpc_keys_apply(grpc_port)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)


@pytest.mark.kafka
async def test_every_route_of_the_fetcher_service_is_behind_the_keys(
    fetcher_service: FastAPI, embedded: FastAPI
) -> None:
    await walk(fetcher_service, OPEN)
    # The same control plane as ragstream up: every route of up but search, none of its own.
    assert routes_of(fetcher_service) == routes_of(embedded) - {("POST", "/v1/search")}


async def test_a_route_added_later_is_admin_only(embedded: FastAPI) -> None:
    @embedded.get("/v1/added-later")
    async def added_later() -> dict[str, str]:
        return {"status": "reached"}

    async with client_of(embedded) as client:
        assert (await client.get("/v1/added-later")).status_code == 401
        assert (await client.get("/v1/added-later", headers=bearer(SEARCH))).status_code == 403
        assert (await client.get("/v1/added-later", headers=bearer(ADMIN))).json() == {"status": "reached"}
        # Unknown paths ask for a key first, so they say nothing of which routes exist.
        assert (await client.get("/v1/unknown")).status_code == 401
        assert (await client.get("/v1/unknown", headers=bearer(SEARCH))).status_code == 403
        assert (await client.get("/v1/unknown", headers=bearer(ADMIN))).status_code == 404


# --- the principal rule ------------------------------------------------------------------------------


@dataclass
class Restricted:
    scope: str
    document: str


@pytest.fixture
async def restricted(runtime: Runtime) -> Restricted:
    scope = await connection(runtime)
    text = "The board minutes of the merger vote: the acquisition price and the timeline."
    return Restricted(scope, await index(runtime, scope, "board.md", [text], acl=["group:board"]))


def search_body(restricted: Restricted, principal: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"query": "board minutes merger", "filters": {"connection_ids": [restricted.scope]}}
    return body | ({"principal": principal} if principal is not None else {})


def reader_app(runtime: Runtime, access: Access | None) -> FastAPI:
    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    return create_app(lambda: runtime.retriever, ready=ready, reader=lambda: reader, access=access)


async def test_only_a_search_key_asserts_a_principal(runtime: Runtime, restricted: Restricted) -> None:
    board = {"user": "ceo", "groups": ["board"]}
    async with client_of(reader_app(runtime, ACCESS)) as client:

        async def search(key: str, principal: dict[str, Any] | None) -> httpx.Response:
            return await client.post("/v1/search", json=search_body(restricted, principal), headers=bearer(key))

        async def read(key: str, params: dict[str, Any]) -> httpx.Response:
            return await client.get(f"/v1/documents/{restricted.document}", params=params, headers=bearer(key))

        found = await search(SEARCH, board)
        assert [result["document_id"] for result in found.json()["results"]] == [restricted.document]
        assert (await read(SEARCH, {"user": "ceo", "groups": "board"})).status_code == 200
        assert (await search(SEARCH, None)).json()["results"] == []  # no principal: unrestricted chunks only

        # An admin key is an operator's: it may search, but never borrow a user's permissions.
        assert (await search(ADMIN, None)).json()["results"] == []
        refused = await search(ADMIN, board)
        assert refused.status_code == 403 and "board" not in refused.text
        assert (await read(ADMIN, {"user": "ceo", "groups": "board"})).status_code == 403
        assert (await read(ADMIN, {})).status_code == 404  # the same answer as an unknown document


async def test_without_keys_every_call_may_assert_a_principal(runtime: Runtime, restricted: Restricted) -> None:
    async with client_of(reader_app(runtime, None)) as client:
        found = await client.post("/v1/search", json=search_body(restricted, {"user": "ceo", "groups": ["board"]}))
        assert [result["document_id"] for result in found.json()["results"]] == [restricted.document]
        read = await client.get(f"/v1/documents/{restricted.document}", params={"user": "x", "groups": "board"})
        assert read.status_code == 200
        assert (await client.post("/v1/search", json=search_body(restricted, None))).json()["results"] == []


# --- gRPC --------------------------------------------------------------------------------------------


@pytest.fixture
async def grpc_channel(runtime: Runtime) -> AsyncIterator[grpc.aio.Channel]:
    async with (
        grpc_server(lambda: runtime.retriever, host="127.0.0.1", port=0, access=ACCESS, max_receive_bytes=4096) as port,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield channel


def grpc_request(
    restricted: Restricted, principal: retrieval_pb2.Principal | None = None
) -> retrieval_pb2.SearchRequest:
    message = retrieval_pb2.SearchRequest(query="board minutes merger")
    message.filters.connection_ids.values.append(restricted.scope)
    if principal is not None:
        message.principal.CopyFrom(principal)
    return message


async def grpc_status(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_grpc_checks_keys_roles_and_the_principal_rule(
    grpc_channel: grpc.aio.Channel, restricted: Restricted
) -> None:
    stub = retrieval_pb2_grpc.RetrievalStub(grpc_channel)
    board = retrieval_pb2.Principal(user="ceo", groups=["board"])

    def metadata(key: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {key}")]

    assert await grpc_status(stub.Search(grpc_request(restricted))) == grpc.StatusCode.UNAUTHENTICATED
    wrong = stub.Search(grpc_request(restricted), metadata=metadata(WRONG))
    assert await grpc_status(wrong) == grpc.StatusCode.UNAUTHENTICATED
    found = await stub.Search(grpc_request(restricted, board), metadata=metadata(SEARCH))
    assert [result.document_id for result in found.results] == [restricted.document]
    assert not (await stub.Search(grpc_request(restricted), metadata=metadata(ADMIN))).results
    borrowed = stub.Search(grpc_request(restricted, board), metadata=metadata(ADMIN))
    assert await grpc_status(borrowed) == grpc.StatusCode.PERMISSION_DENIED
    batch = retrieval_pb2.SearchBatchRequest(requests=[grpc_request(restricted), grpc_request(restricted, board)])
    assert await grpc_status(stub.SearchBatch(batch, metadata=metadata(ADMIN))) == grpc.StatusCode.PERMISSION_DENIED
    assert len((await stub.SearchBatch(batch, metadata=metadata(SEARCH))).responses) == 2
    # A message over the receive limit (4 KiB here) is refused before any search.
    huge = retrieval_pb2.SearchRequest(query="x" * 8000)
    assert await grpc_status(stub.Search(huge, metadata=metadata(SEARCH))) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Health needs no key: a Kubernetes probe has none.
    checked = await health_pb2_grpc.HealthStub(grpc_channel).Check(health_pb2.HealthCheckRequest())
    assert checked.status == health_pb2.HealthCheckResponse.SERVING


# --- body limit --------------------------------------------------------------------------------------


async def test_a_body_over_the_limit_gets_413_declared_or_streamed(runtime: Runtime) -> None:
    app = create_app(lambda: runtime.retriever, ready=ready, access=ACCESS, max_request_bytes=2048)
    padding = "x" * 4096
    async with client_of(app) as client:
        declared = await client.post("/v1/search", json={"query": padding}, headers=bearer(SEARCH))
        assert declared.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"query": "'
            for _ in range(8):
                yield b"y" * 512
            yield b'"}'

        streamed = await client.post(
            "/v1/search", content=chunks(), headers={**bearer(SEARCH), "content-type": "application/json"}
        )
        assert "content-length" not in streamed.request.headers
        assert streamed.status_code == 413
        small = await client.post("/v1/search", json={"query": "kafka"}, headers=bearer(SEARCH))
        assert small.status_code == 200
        # The key is checked before the body is read.
        assert (await client.post("/v1/search", json={"query": padding})).status_code == 401


# --- start-up ---------------------------------------------------------------------------------------


def test_services_refuse_to_start_without_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragstream_fetcher.main import create_app as create_fetcher
    from ragstream_retriever.main import create_app as create_retriever

    monkeypatch.delenv("RAGSTREAM_API_KEYS", raising=False)
    monkeypatch.delenv("RAGSTREAM_AUTH", raising=False)
    for create in (create_retriever, create_fetcher):
        with pytest.raises(AccessSetupError, match="RAGSTREAM_API_KEYS"):
            create()
    monkeypatch.setenv("RAGSTREAM_AUTH", "none")  # explicitly: a mesh authenticates
    for create in (create_retriever, create_fetcher):
        assert isinstance(create(), FastAPI)


def test_key_settings_fail_clearly_and_never_echo_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hunter2-" + "h" * 20
    for value, reason in [
        (f"root:{secret}", "ROLE admin or search"),
        (f"admin{secret}", "ROLE admin or search"),
        ("search:short", "at least 16"),
        (f"admin:{secret},search:{secret}", "appears twice"),
    ]:
        with pytest.raises(ValidationError, match=reason) as raised:
            Settings(api_keys=value)
        assert secret not in str(raised.value)
    with pytest.raises(ValidationError, match="contradicts"):
        Settings(api_keys=KEYS, auth="none")
    monkeypatch.setenv("RAGSTREAM_API_KEYS", "")  # an unset compose variable
    assert Settings().api_keys is None
    assert secret not in repr(Settings(api_keys=f"admin:{secret}"))


def test_up_without_keys_refuses_a_non_loopback_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGSTREAM_API_KEYS", raising=False)
    monkeypatch.delenv("RAGSTREAM_AUTH", raising=False)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert not Access.for_embedded(Settings(), host).enforced
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(AccessSetupError, match="RAGSTREAM_API_KEYS"):
            Access.for_embedded(Settings(), host)
    assert Access.for_embedded(Settings(api_keys=KEYS), "0.0.0.0").enforced
    # The command refuses before it starts a store, and says why.
    refused = subprocess.run(
        [sys.executable, "-m", "ragstream.cli", "up", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "RAGSTREAM_DATA_DIR": "/nonexistent"},
        check=False,
    )
    assert refused.returncode == 2
    assert "RAGSTREAM_API_KEYS" in refused.stderr


# --- property: zero leaks over keys, principals and ACLs -------------------------------------------

TEXTS = [
    "Kafka retention keeps the orderbook topic for nine days before compaction.",
    "PostgreSQL base backups run nightly with pgBackRest and are verified weekly.",
    "Quarterly salary review: bands, promotions and the budget for the platform team.",
    "Incident review for the payment outage: timeline, root cause and follow-ups.",
]
QUERIES = ["kafka retention", "postgresql backups", "salary review", "incident root cause"]
USERS = ["alice", "bob"]
GROUPS = ["eng", "hr"]
PRINCIPALS = [f"user:{user}" for user in USERS] + [f"group:{group}" for group in GROUPS]


@dataclass
class Corpus:
    scope: str
    documents: list[str]
    chunks: dict[str, tuple[str, str]]  # chunk id: (document id, its marker)


@pytest.fixture(scope="module")
async def corpus_index(runtime: Runtime) -> Corpus:
    """Four documents of two chunks each; every chunk's text carries a marker of its own."""
    scope = await connection(runtime)
    documents = []
    for number, text in enumerate(TEXTS):
        texts = [f"{text} Marker m{number}a.", f"{TEXTS[(number + 1) % 4]} Marker m{number}b."]
        documents.append(await index(runtime, scope, f"leak{number}.md", texts))
    rows = await runtime.pool.fetch(
        "SELECT id, document_id, text FROM chunks WHERE document_id = ANY($1::text[])", documents
    )
    markers = {row["id"]: (row["document_id"], re.findall(r"Marker m\d[ab]\.", row["text"])[0]) for row in rows}
    return Corpus(scope, documents, markers)


@pytest.fixture(scope="module")
def leak_app(runtime: Runtime) -> Iterator[FastAPI]:
    yield reader_app(runtime, ACCESS)


acl_strategy = st.none() | st.lists(st.sampled_from(PRINCIPALS), max_size=2, unique=True)
principal_strategy = st.none() | st.builds(
    Principal, user=st.sampled_from(USERS), groups=st.lists(st.sampled_from(GROUPS), max_size=2, unique=True)
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    acls=st.lists(acl_strategy, min_size=8, max_size=8),
    # Search first: hypothesis favours the first choice, and authorized calls are where a leak could be.
    key=st.sampled_from([SEARCH, ADMIN, None, WRONG]),
    principal=principal_strategy,
    read=st.booleans(),
    query=st.sampled_from(QUERIES),
    document=st.integers(0, 3),
)
async def test_no_chunk_reaches_a_caller_its_key_and_acl_do_not_allow(
    runtime: Runtime,
    corpus_index: Corpus,
    leak_app: FastAPI,
    acls: list[list[str] | None],
    key: str | None,
    principal: Principal | None,
    read: bool,
    query: str,
    document: int,
) -> None:
    acl_of = dict(zip(sorted(corpus_index.chunks), acls, strict=True))
    for chunk, acl in acl_of.items():
        await runtime.pool.execute("UPDATE chunks SET acl = $2 WHERE id = $1", chunk, acl)
    authorized = key in (ADMIN, SEARCH) and (principal is None or key == SEARCH)
    seen = set(principal.principals()) if principal is not None and authorized else set()
    allowed = {chunk for chunk, acl in acl_of.items() if acl is None or seen & set(acl)}

    async with client_of(leak_app) as client:
        if read:
            params: dict[str, Any] = {"user": principal.user, "groups": principal.groups} if principal else {}
            target = corpus_index.documents[document]
            response = await client.get(f"/v1/documents/{target}", params=params, headers=bearer(key))
        else:
            body: dict[str, Any] = {"query": query, "top_k": 30, "filters": {"connection_ids": [corpus_index.scope]}}
            if principal is not None:
                body["principal"] = principal.model_dump()
            response = await client.post("/v1/search", json=body, headers=bearer(key))

    if key not in (ADMIN, SEARCH):
        assert response.status_code == 401
    elif not authorized:
        assert response.status_code == 403
    elif read and not any(corpus_index.chunks[chunk][0] == target for chunk in allowed):
        assert response.status_code == 404
    else:
        assert response.status_code == 200
        if not read:
            returned = {result["chunk_id"] for result in response.json()["results"]}
            assert returned <= allowed
    # Whatever the answer, no marker of a chunk the caller may not see is in it.
    leaked = [marker for chunk, (_, marker) in corpus_index.chunks.items() if chunk not in allowed]
    assert not [marker for marker in leaked if marker in response.text]
