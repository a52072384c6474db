"""Scope and permissions on a real PostgreSQL: every filter kind, connection and document state,
per-chunk ACLs (with a property test over random ACLs, callers and queries), and a vector leg that
still returns its candidates under a selective ACL."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragstream.messages import ChunkPayload, DocumentDeleted, DocumentHeader
from ragstream.retrieval import (
    HybridRetriever,
    Principal,
    RetrievalSettings,
    SearchFilters,
    SearchRequest,
    SearchResponse,
)
from ragstream.runtime import Runtime
from ragstream.storage.citations import CitationStore
from ragstream.storage.documents import document_id
from ragstream.storage.scope import Scope
from ragstream.storage.search import SearchStore

pytestmark = pytest.mark.integration

_vectors: dict[str, np.ndarray] = {}


async def embed(runtime: Runtime, texts: Sequence[str]) -> np.ndarray:
    """Document vectors of the local embedder, cached: the property test reuses a small pool of texts."""
    missing = [text for text in dict.fromkeys(texts) if text not in _vectors]
    if missing:
        _vectors.update(zip(missing, await runtime.embedder.embed(missing), strict=True))
    return np.stack([_vectors[text] for text in texts])


async def connection(
    runtime: Runtime, platform: str = "folder", *, status: str = "active", skip_acl: bool = False
) -> str:
    """A fresh connection, so each test (and each property example) has a scope of its own."""
    connection_id = f"{platform}-{uuid.uuid4().hex[:12]}"
    await runtime.store.ensure_connection(connection_id, platform, connection_id)
    # Status and skip_acl have no setter: skip_acl is fixed when a connection is created.
    await runtime.pool.execute(
        "UPDATE connections SET status = $2, skip_acl = $3 WHERE id = $1", connection_id, status, skip_acl
    )
    return connection_id


async def index(
    runtime: Runtime,
    connection_id: str,
    external_id: str,
    texts: Sequence[str],
    *,
    acl: list[str] | None = None,
    knowledge_base: str = "",
    metadata: dict[str, Any] | None = None,
    vectors: np.ndarray | None = None,
    model_key: str | None = None,
) -> str:
    """Commit a document the way the indexer does; returns its id."""
    document = document_id(connection_id, external_id)
    header = DocumentHeader(
        document_id=document,
        connection_id=connection_id,
        external_id=external_id,
        version=await runtime.store.next_version(),
        content_hash=external_id,
        title=external_id.rsplit("/", 1)[-1],
        source=external_id,
        media_type="text/markdown",
        knowledge_base=knowledge_base,
        url=f"https://example.test/{external_id}",
        acl=acl,
        metadata=metadata or {},
    )
    chunks = [ChunkPayload(ordinal=i, heading=header.title, text=text) for i, text in enumerate(texts)]
    await runtime.store.commit_document(
        header,
        chunks,
        await embed(runtime, texts) if vectors is None else vectors,
        model_key or runtime.embedder.model_key,
    )
    return document


async def found(runtime: Runtime, query: str, filters: SearchFilters, principal: Principal | None = None) -> set[str]:
    response = await runtime.retriever.search(
        SearchRequest(query=query, top_k=30, filters=filters, principal=principal)
    )
    return {result.document_id for result in response.results}


async def test_each_filter_kind_narrows_the_scope(runtime: Runtime) -> None:
    feishu, yuque = await connection(runtime, "feishu"), await connection(runtime, "yuque")
    text = "The zebrafish husbandry protocol: feed twice daily and keep the water at 28 degrees."
    docs = {
        "a1": await index(
            runtime, feishu, "eng/a1.md", [text], knowledge_base="eng", metadata={"lang": "en", "year": 2024}
        ),
        "a2": await index(runtime, feishu, "ops/a2.md", [text], knowledge_base="ops", metadata={"lang": "zh"}),
        "b1": await index(
            runtime, yuque, "eng/b1.md", [text], knowledge_base="eng", metadata={"lang": "en", "year": 2023}
        ),
        "b2": await index(runtime, yuque, "hr/b2.md", [text], knowledge_base="hr", metadata={"reviewed": True}),
    }
    both = [feishu, yuque]

    async def documents(**narrowing: Any) -> set[str]:
        ids = await found(runtime, "zebrafish protocol", SearchFilters(connection_ids=both, **narrowing))
        return {name for name, document in docs.items() if document in ids}

    assert await documents() == {"a1", "a2", "b1", "b2"}
    assert await found(runtime, "zebrafish protocol", SearchFilters(connection_ids=[feishu])) == {
        docs["a1"],
        docs["a2"],
    }
    assert await documents(platforms=["yuque"]) == {"b1", "b2"}
    assert await documents(platforms=["yuque", "feishu"]) == {"a1", "a2", "b1", "b2"}
    assert await documents(knowledge_bases=["eng"]) == {"a1", "b1"}
    assert await documents(knowledge_bases=["eng"], platforms=["feishu"]) == {"a1"}
    assert await documents(sources=["ops/a2.md", "hr/b2.md"]) == {"a2", "b2"}
    assert await documents(metadata={"lang": "en"}) == {"a1", "b1"}
    assert await documents(metadata={"lang": "en", "year": 2023}) == {"b1"}
    assert await documents(metadata={"reviewed": True}) == {"b2"}
    assert await documents(metadata={"year": "2024"}) == set()  # typed: the string is not the number
    assert await documents(knowledge_bases=["nowhere"]) == set()


async def test_disabled_archived_and_deleted_never_appear(runtime: Runtime) -> None:
    text = "Quokka census results for the northern island, counted at dawn."
    active = await connection(runtime)
    disabled = await connection(runtime, status="disabled")
    archived = await connection(runtime, status="archived")
    kept = await index(runtime, active, "kept.md", [text])
    gone = await index(runtime, active, "gone.md", [text])
    await index(runtime, disabled, "d.md", [text])
    await index(runtime, archived, "a.md", [text])
    await runtime.store.delete_document(
        DocumentDeleted(
            document_id=gone,
            connection_id=active,
            external_id="gone.md",
            source="gone.md",
            version=await runtime.store.next_version(),
        )
    )
    scope = SearchFilters(connection_ids=[active, disabled, archived])
    assert await found(runtime, "quokka census", scope) == {kept}
    everyone = Principal(user="root", groups=["admins"])
    assert await found(runtime, "quokka census", scope, everyone) == {kept}

    # Disabling a connection hides what it already indexed, at once.
    await runtime.pool.execute("UPDATE connections SET status = 'disabled' WHERE id = $1", active)
    assert await found(runtime, "quokka census", scope) == set()


async def test_acl_rules_and_a_connection_that_skips_them(runtime: Runtime) -> None:
    text = "Salary bands for the platform team, effective next quarter."
    checked = await connection(runtime)
    open_for_all = await connection(runtime, skip_acl=True)
    public = await index(runtime, checked, "public.md", [text])
    alice = await index(runtime, checked, "alice.md", [text], acl=["user:alice"])
    hr = await index(runtime, checked, "hr.md", [text], acl=["group:hr", "user:bob"])
    nobody = await index(runtime, checked, "nobody.md", [text], acl=[])
    served = await index(runtime, open_for_all, "served.md", [text], acl=["user:nobody-at-all"])
    scope = SearchFilters(connection_ids=[checked, open_for_all])

    async def visible(principal: Principal | None) -> set[str]:
        return await found(runtime, "salary bands", scope, principal)

    assert await visible(None) == {public, served}  # no caller: unrestricted chunks only
    assert await visible(Principal(user="alice")) == {public, alice, served}
    assert await visible(Principal(user="bob")) == {public, hr, served}
    assert await visible(Principal(user="carol", groups=["hr"])) == {public, hr, served}
    assert await visible(Principal(user="carol", groups=["eng"])) == {public, served}
    # Principals are typed: a group named like a user is not that user.
    assert await visible(Principal(user="dave", groups=["alice"])) == {public, served}
    assert nobody not in await visible(Principal(user="alice", groups=["hr", "eng"]))


# --- property: zero leaks ---------------------------------------------------------------------------

POOL = [
    "Kafka retention keeps the orderbook topic for nine days before compaction.",
    "Consumer groups rebalance when a member leaves; shorten the session timeout in tests.",
    "PostgreSQL base backups run nightly with pgBackRest and are verified weekly.",
    "Vacuum reclaims dead rows; autovacuum thresholds depend on the table size.",
    "The HNSW index trades recall for speed through the ef_search setting.",
    "Quarterly salary review: bands, promotions and the budget for the platform team.",
    "Incident review for the payment outage: timeline, root cause and follow-ups.",
    "Onboarding checklist: laptop, accounts, the Kafka and PostgreSQL runbooks.",
    "Retention of audit logs is seven years; backups are encrypted at rest.",
    "The orderbook service publishes trades to Kafka and stores snapshots in PostgreSQL.",
]
QUERIES = ["kafka retention", "postgresql backups", "salary review", "incident root cause", "orderbook", "vacuum"]
USERS = ["alice", "bob", "carol"]
GROUPS = ["eng", "hr", "ops"]
PRINCIPALS = [f"user:{user}" for user in USERS] + [f"group:{group}" for group in GROUPS]

documents_strategy = st.lists(
    st.tuples(
        st.lists(st.sampled_from(range(len(POOL))), min_size=1, max_size=3),
        st.none() | st.lists(st.sampled_from(PRINCIPALS), max_size=3, unique=True),
    ),
    min_size=1,
    max_size=20,
)
principal_strategy = st.none() | st.builds(
    Principal, user=st.sampled_from(USERS), groups=st.lists(st.sampled_from(GROUPS), max_size=2, unique=True)
)


def may_see(principal: Principal | None, acl: list[str] | None) -> bool:
    return acl is None or bool(set(acl) & set(principal.principals() if principal else []))


def results_of(response: SearchResponse) -> list[dict[str, Any]]:
    return [result.model_dump() for result in response.results]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    documents=documents_strategy,
    principal=principal_strategy,
    query=st.sampled_from(QUERIES),
    top_k=st.integers(1, 30),
    leg_size=st.sampled_from([3, 30]),
)
async def test_no_chunk_the_caller_may_not_see_is_returned_counted_or_hinted(
    runtime: Runtime,
    documents: list[tuple[list[int], list[str] | None]],
    principal: Principal | None,
    query: str,
    top_k: int,
    leg_size: int,
) -> None:
    # Legs of 3 as well as the default 30: with short legs, a hidden chunk that took a place in a
    # leg would push a visible one out in most examples, not only in the largest.
    retriever = HybridRetriever(
        SearchStore(runtime.pool),
        runtime.embedder,
        CitationStore(runtime.pool),
        settings=RetrievalSettings(leg_size=leg_size),
    )
    scope, attic = await connection(runtime), await connection(runtime)
    hidden: set[str] = set()  # ids of documents and chunks the caller may not see
    hidden_documents = []
    for number, (texts, acl) in enumerate(documents):
        document = await index(runtime, scope, f"doc{number}.md", [POOL[i] for i in texts], acl=acl)
        if not may_see(principal, acl):
            hidden_documents.append(document)
            hidden.add(document)
    hidden.update(
        row["id"]
        for row in await runtime.pool.fetch(
            "SELECT id FROM chunks WHERE document_id = ANY($1::text[])", hidden_documents
        )
    )
    request = SearchRequest(
        query=query, top_k=top_k, filters=SearchFilters(connection_ids=[scope]), principal=principal
    )
    response = await retriever.search(request)

    # Nothing the caller may not see is returned, nor named anywhere in the response.
    serialized = response.model_dump_json()
    assert not [identifier for identifier in hidden if identifier in serialized]

    # The same search over only what the caller may see gives the same answer, ranks and scores
    # included: hidden chunks did not take a rank, shift a score, or use up a citation number.
    # The hidden documents move to another connection, so they leave the scope but stay in the
    # corpus (whose size the keyword ranking may use) and no ACL decides anything any more.
    await runtime.pool.execute(
        "UPDATE documents SET connection_id = $2 WHERE id = ANY($1::text[])", hidden_documents, attic
    )
    assert results_of(await retriever.search(request)) == results_of(response)


# --- the vector leg under a selective ACL -----------------------------------------------------------


async def test_a_selective_acl_still_fills_the_vector_leg(runtime: Runtime) -> None:
    """pgvector 0.6 filters after the HNSW scan; the leg must still return min(30, visible)."""
    rng = np.random.default_rng(3)
    # Enough rows that PostgreSQL plans the HNSW index (on a few hundred it sorts them all instead).
    dimension, documents, per_document = 32, 80, 60
    model_key = f"test-selective-acl-{uuid.uuid4().hex[:8]}"
    scope_id = await connection(runtime)
    vectors = rng.normal(size=(documents * per_document + 12, dimension)).astype(np.float32)
    # Documents 0-39 lie around one point, readable by group "near"; 40-79 around the opposite
    # point, each readable by one of 8 groups, and one more document of 12 chunks there by group
    # "few". The query sits among the "near" half: the other groups' chunks are rare (6 %, 12 %,
    # 0.25 %) and absent from its neighbourhood, where pgvector's post-filter would look.
    centre = rng.normal(size=dimension).astype(np.float32)
    half = documents // 2 * per_document
    vectors[:half] += 3 * centre
    vectors[half:] -= 3 * centre
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    acl_of: dict[str, list[str]] = {}
    for number in range(documents + 1):
        acl = ["group:near"] if number < documents // 2 else [f"group:g{number % 8}"]
        rows = slice(number * per_document, (number + 1) * per_document)
        if number == documents:
            acl = ["group:few"]
        document = await index(
            runtime,
            scope_id,
            f"v{number}.md",
            [f"chunk {i} of v{number}" for i in range(len(vectors[rows]))],
            acl=acl,
            vectors=vectors[rows],
            model_key=model_key,
        )
        acl_of[document] = acl
    order = list(acl_of)
    chunks = {
        row["id"]: (row["document_id"], order.index(row["document_id"]) * per_document + row["ordinal"])
        for row in await runtime.pool.fetch(
            "SELECT c.id, c.document_id, c.ordinal FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.connection_id = $1",
            scope_id,
        )
    }
    query = (3 * centre + rng.normal(size=dimension)).astype(np.float32)
    query /= np.linalg.norm(query)
    store = SearchStore(runtime.pool)
    table = await store.embedding_table(model_key)
    assert table is not None
    # Statistics as a live database has them: without, the planner believes the scope holds one
    # row and sorts the scoped rows itself, never meeting the HNSW index and its post-filter.
    for analysed in ("connections", "documents", "chunks", table):
        await runtime.pool.execute(f"ANALYZE {analysed}")

    def exact(principal: Principal | None) -> list[str]:
        visible = [chunk for chunk, (document, _) in chunks.items() if may_see(principal, acl_of[document])]
        distance = {chunk: 1 - float(vectors[chunks[chunk][1]] @ query) for chunk in visible}
        return sorted(visible, key=lambda chunk: (distance[chunk], chunk))[:30]

    cases = {
        "half the chunks, around the query": (Principal(user="u", groups=["near"]), 30),
        "one group: 300 chunks (6 %), all far away": (Principal(user="u", groups=["g0"]), 30),
        "two groups: 600 chunks (12 %), far away": (Principal(user="u", groups=["g2", "g3"]), 30),
        "12 chunks (0.25 %)": (Principal(user="u", groups=["few"]), 12),
        "no caller: nothing unrestricted": (None, 0),
    }
    for name, (principal, size) in cases.items():
        # No connection filter: only this test writes to this embedding table, so the ACL alone
        # decides, as it would for a caller searching everything.
        scope = Scope.build(SearchFilters(), principal, first_param=3)
        leg = [hit.chunk_id for hit in await store.vector_leg(table, query, 30, scope)]
        expected = exact(principal)
        assert len(leg) == len(expected) == size, name
        assert all(may_see(principal, acl_of[chunks[chunk][0]]) for chunk in leg), name
        assert len(set(leg) & set(expected)) >= 0.9 * size, name  # recall@30 of at least 0.9
