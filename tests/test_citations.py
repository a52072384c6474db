"""Citation numbers that stay stable within a conversation, across searches and document reads, and
``GET /v1/documents/{id}`` under the same scope and permission rules as search."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from ragstream.api.http import create_app
from ragstream.messages import ChunkPayload, DocumentDeleted, DocumentHeader
from ragstream.retrieval import SearchFilters, SearchRequest
from ragstream.retrieval.reader import DocumentReader, join_chunks
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.documents import document_id
from ragstream.storage.documents_read import DocumentReadStore

pytestmark = pytest.mark.integration


async def ready() -> bool:
    return True


async def connection(runtime: Runtime, platform: str = "folder") -> str:
    connection_id = f"{platform}-{uuid.uuid4().hex[:12]}"
    await runtime.store.ensure_connection(connection_id, platform, connection_id)
    return connection_id


async def index(
    runtime: Runtime, connection_id: str, external_id: str, texts: list[str], *, acl: list[str] | None = None
) -> str:
    document = document_id(connection_id, external_id)
    header = DocumentHeader(
        document_id=document,
        connection_id=connection_id,
        external_id=external_id,
        version=await runtime.store.next_version(),
        content_hash=external_id,
        title=f"Title of {external_id}",
        source=external_id,
        media_type="text/markdown",
        knowledge_base="handbook",
        url=f"https://wiki.example.test/{external_id}",
        acl=acl,
        metadata={"team": "platform"},
    )
    chunks = [ChunkPayload(ordinal=i, heading=header.title, text=text) for i, text in enumerate(texts)]
    vectors = await runtime.embedder.embed(texts)
    await runtime.store.commit_document(header, chunks, vectors, runtime.embedder.model_key)
    return document


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    reader = DocumentReader(DocumentReadStore(runtime.pool), CitationStore(runtime.pool))
    app = create_app(lambda: runtime.retriever, ready=ready, reader=lambda: reader)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as opened:
        yield opened


async def numbers_of(runtime: Runtime, conversation: str, scope: str, sources: list[str]) -> dict[str, int]:
    response = await runtime.retriever.search(
        SearchRequest(
            query="lighthouse maintenance",
            top_k=10,
            conversation_id=conversation,
            filters=SearchFilters(connection_ids=[scope], sources=sources),
        )
    )
    return {result.source: result.citation_index for result in response.results}


async def test_numbers_hold_across_searches_and_reads_of_a_conversation(
    runtime: Runtime, client: httpx.AsyncClient
) -> None:
    scope = await connection(runtime)
    text = "Lighthouse maintenance: clean the lens, check the lamp, log the visit."
    ids = {name: await index(runtime, scope, name, [f"{text} ({name})"]) for name in ("x.md", "y.md", "z.md", "w.md")}
    conversation = f"conv-{uuid.uuid4().hex}"

    first = await numbers_of(runtime, conversation, scope, ["x.md", "y.md"])
    assert sorted(first.values()) == [1, 2]
    second = await numbers_of(runtime, conversation, scope, ["y.md", "z.md"])
    assert second == {"y.md": first["y.md"], "z.md": 3}

    read = await client.get(f"/v1/documents/{ids['x.md']}", params={"conversation_id": conversation})
    assert read.status_code == 200
    assert read.json()["citation_index"] == first["x.md"]
    read = await client.get(f"/v1/documents/{ids['w.md']}", params={"conversation_id": conversation})
    assert read.json()["citation_index"] == 4
    assert await numbers_of(runtime, conversation, scope, ["w.md", "x.md", "z.md"]) == {
        "w.md": 4,
        "x.md": first["x.md"],
        "z.md": 3,
    }

    # Another conversation numbers from 1; no conversation numbers within the response.
    fresh = await numbers_of(runtime, f"conv-{uuid.uuid4().hex}", scope, ["z.md"])
    assert fresh == {"z.md": 1}
    read = await client.get(f"/v1/documents/{ids['z.md']}")
    assert read.json()["citation_index"] == 1


async def test_concurrent_assignments_in_one_conversation_never_share_a_number(runtime: Runtime) -> None:
    citations = CitationStore(runtime.pool)
    conversation = f"conv-{uuid.uuid4().hex}"
    documents = [f"doc-{i}" for i in range(12)]
    rng = random.Random(5)
    calls = [rng.sample(documents, rng.randint(1, len(documents))) for _ in range(24)]

    answers = await asyncio.gather(*(citations.assign(conversation, call) for call in calls))

    final = await citations.assign(conversation, documents)
    assert sorted(final.values()) == list(range(1, len(documents) + 1))
    for call, answer in zip(calls, answers, strict=True):
        assert answer == {document: final[document] for document in call}


async def test_a_read_returns_the_source_card_and_the_text_in_order(
    runtime: Runtime, client: httpx.AsyncClient
) -> None:
    scope = await connection(runtime, "feishu")
    chunks = [
        "## Intro\nThe first part. It continues here.",
        "It continues here. Then the second part.",  # overlaps the first, as the chunkers do
        "## Next\nA new section.",
    ]
    document = await index(runtime, scope, "guide.md", chunks)

    response = await client.get(f"/v1/documents/{document}")
    assert response.status_code == 200
    body = response.json()
    assert {key: body[key] for key in ("title", "platform", "knowledge_base", "source", "url", "truncated")} == {
        "title": "Title of guide.md",
        "platform": "feishu",
        "knowledge_base": "handbook",
        "source": "guide.md",
        "url": "https://wiki.example.test/guide.md",
        "truncated": False,
    }
    assert body["metadata"] == {"team": "platform"}
    assert body["text"] == (
        "## Intro\nThe first part. It continues here. Then the second part.\n\n## Next\nA new section."
    )

    cut = (await client.get(f"/v1/documents/{document}", params={"max_chars": 40})).json()
    assert cut["truncated"] and len(cut["text"]) <= 42 and cut["text"].startswith("## Intro")
    assert (await client.get(f"/v1/documents/{document}", params={"max_chars": 12001})).status_code == 422


def test_join_chunks_drops_overlaps_and_keeps_the_budget() -> None:
    assert join_chunks(["Alpha beta gamma delta.", "gamma delta. Epsilon."], 100) == (
        "Alpha beta gamma delta. Epsilon.",
        False,
    )
    assert join_chunks(["One.", "Two."], 100) == ("One.\n\nTwo.", False)  # too short to be an overlap
    assert join_chunks(["Repeated text here.", "Repeated text here."], 100) == ("Repeated text here.", False)
    text, truncated = join_chunks(["First sentence. " * 50], 100)
    assert truncated and len(text) <= 102


async def test_a_forbidden_document_reads_like_an_unknown_one(runtime: Runtime, client: httpx.AsyncClient) -> None:
    scope = await connection(runtime)
    secret = await index(runtime, scope, "secret.md", ["Acquisition plans for next year."], acl=["group:board"])
    mixed = await index(runtime, scope, "public.md", ["Opening hours of the canteen."])
    deleted = await index(runtime, scope, "old.md", ["An outdated policy."])
    await runtime.store.delete_document(
        DocumentDeleted(
            document_id=deleted,
            connection_id=scope,
            external_id="old.md",
            source="old.md",
            version=await runtime.store.next_version(),
        )
    )
    conversation = f"conv-{uuid.uuid4().hex}"

    async def read(document: str, **params: str | list[str]) -> httpx.Response:
        return await client.get(f"/v1/documents/{document}", params={"conversation_id": conversation, **params})

    unknown = await read("0" * 32, user="mallory")
    assert unknown.status_code == 404
    for response in (
        await read(secret),
        await read(secret, user="mallory", groups=["staff"]),
        await read(deleted, user="ceo", groups=["board"]),
    ):
        assert (response.status_code, response.json()) == (unknown.status_code, unknown.json())
    # None of those used up a number: the first document this conversation may read gets 1.
    assert (await read(mixed)).json()["citation_index"] == 1
    allowed = await read(secret, user="ceo", groups="staff,board")
    assert allowed.status_code == 200 and allowed.json()["citation_index"] == 2
    assert (await read(secret, user="ceo", groups=["staff", "board"])).json()["citation_index"] == 2
    assert (await read(secret, groups=["board"])).status_code == 422  # groups without a user

    # A disabled connection hides its documents from reads as from searches.
    await runtime.pool.execute("UPDATE connections SET status = 'disabled' WHERE id = $1", scope)
    response = await read(mixed)
    assert (response.status_code, response.json()) == (unknown.status_code, unknown.json())


async def test_reads_answer_503_until_the_index_is_open(runtime: Runtime) -> None:
    app = create_app(lambda: runtime.retriever, ready=ready, reader=lambda: None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/v1/documents/abc")).status_code == 503
