"""The keyword leg against a real PostgreSQL: BM25 in SQL, Chinese words, identifiers, scope."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence

import numpy as np
import pytest

from ragstream.messages import ChunkPayload, DocumentHeader, IndexOutcome
from ragstream.retrieval import Principal, SearchFilters
from ragstream.runtime import Runtime, open_runtime
from ragstream.segmentation import query_terms
from ragstream.storage.documents import document_id
from ragstream.storage.scope import Scope
from ragstream.storage.search import KeywordRanking, SearchStore, _CorpusStats
from tests.support.connections import private_database

pytestmark = pytest.mark.integration


async def index(
    runtime: Runtime,
    documents: dict[str, str],
    *,
    connection: str | None = None,
    acl: list[str] | None = None,
    knowledge_base: str = "",
    metadata: dict[str, str | int | float | bool] | None = None,
) -> str:
    """Commit one single-chunk document per text through ``DocumentStore.commit_document`` (which
    writes the tsvector and its lexeme count); returns the connection id. The vectors are
    placeholders: only the keyword leg is under test."""
    connection = connection or f"kw-{uuid.uuid4().hex[:12]}"
    await runtime.store.ensure_connection(connection, "folder", connection)
    embedder = runtime.embedder
    vector = np.full((1, embedder.dimension), 1 / np.sqrt(embedder.dimension), dtype=np.float32)
    for name, text in documents.items():
        header = DocumentHeader(
            document_id=document_id(connection, name),
            connection_id=connection,
            external_id=name,
            version=await runtime.store.next_version(),
            content_hash=hashlib.sha256(text.encode()).hexdigest(),
            title="",
            source=name,
            media_type="text/plain",
            acl=acl,
            knowledge_base=knowledge_base,
            metadata=metadata or {},
        )
        chunk = ChunkPayload(ordinal=0, heading="", text=text)
        assert await runtime.store.commit_document(header, [chunk], vector, embedder.model_key) is IndexOutcome.INDEXED
    return connection


async def found(
    runtime: Runtime,
    query: str | Sequence[str],
    connection: str,
    *,
    ranking: KeywordRanking = "bm25",
    filters: SearchFilters | None = None,
    principal: Principal | None = None,
    limit: int = 10,
    raw: bool = True,
) -> list[str]:
    """Sources of the keyword leg's results, best first, within one connection (unless told).
    ``raw``: pass the query text too, as the retriever does (for its Chinese bigrams)."""
    store = SearchStore(runtime.pool, keyword_ranking=ranking)
    scope = Scope.build(filters or SearchFilters(connection_ids=[connection]), principal, first_param=3)
    terms = query_terms(query) if isinstance(query, str) else list(query)
    text = query if isinstance(query, str) and raw else None
    ids = [hit.chunk_id for hit in await store.keyword_leg(terms, limit, scope, query=text)]
    rows = await runtime.pool.fetch(
        "SELECT c.id, d.source FROM chunks c JOIN documents d ON d.id = c.document_id WHERE c.id = ANY($1)", ids
    )
    source = {row["id"]: row["source"] for row in rows}
    return [source[chunk] for chunk in ids]


async def test_bm25_prefers_rare_terms_frequent_terms_and_short_chunks(runtime: Runtime, database_url: str) -> None:
    # BM25 normalises by corpus-wide statistics (chunk count, average length): in the shared database
    # they depend on what the other tests indexed before, so this ranking is checked on its own corpus.
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        await _check_bm25_preferences(own)


async def _check_bm25_preferences(runtime: Runtime) -> None:
    filler = "the office opens early and closes late on most days of the week"
    connection = await index(
        runtime,
        {
            # 'plumbus' is in every chunk, 'grumbo' in two: a single 'grumbo' outweighs many 'plumbus'.
            "common.txt": f"plumbus plumbus plumbus plumbus plumbus. {filler}",
            "rare-once.txt": f"plumbus grumbo. {filler}",
            "rare-thrice.txt": f"plumbus grumbo grumbo grumbo. {filler}",
            "other-1.txt": f"plumbus. {filler}",
            "other-2.txt": f"plumbus. {filler}",
            "other-3.txt": f"plumbus. {filler}",
            # Same term frequency as rare-once, but much longer: length normalisation ranks it lower.
            "rare-long.txt": f"plumbus grumbo. {filler} {filler} {filler} {filler}",
        },
    )
    ranked = await found(runtime, "plumbus grumbo", connection)
    assert ranked[:3] == ["rare-thrice.txt", "rare-once.txt", "rare-long.txt"]
    assert ranked[3] == "common.txt"  # five plumbus: more than the other plumbus-only chunks
    assert set(ranked) == {"common.txt", "rare-once.txt", "rare-thrice.txt", "rare-long.txt"} | {
        f"other-{n}.txt" for n in (1, 2, 3)
    }
    # ts_rank_cd stays available and finds the same chunks (in its own order).
    assert set(await found(runtime, "plumbus grumbo", connection, ranking="ts_rank")) == set(ranked)
    assert (await found(runtime, "plumbus grumbo", connection, limit=2)) == ranked[:2]


async def test_english_words_match_by_stem(runtime: Runtime) -> None:
    connection = await index(
        runtime,
        {"claims.txt": "Filing claims for flooded basements takes weeks.", "other.txt": "Nothing relevant here."},
    )
    assert await found(runtime, "how do I file a claim for a flood", connection) == ["claims.txt"]


async def test_chinese_words_are_found_by_a_segmented_query(runtime: Runtime) -> None:
    connection = await index(
        runtime,
        {
            "报销.txt": "差旅费用报销需要在三十天内提交发票。",
            "年会.txt": "公司年会在十二月举行，地点另行通知。",
            "混合.txt": "VPN 账号申请请联系 IT 部门，审批后开通。",
        },
    )
    assert await found(runtime, "差旅费用怎么报销", connection) == ["报销.txt"]
    assert await found(runtime, "年会在哪里举行", connection) == ["年会.txt"]
    # Mixed text: the English word and the Chinese word both match.
    assert (await found(runtime, "VPN 申请", connection))[0] == "混合.txt"
    # Stop words alone match nothing rather than everything.
    assert await found(runtime, "的 了 是", connection) == []


async def test_chinese_bigrams_match_what_segmentation_cut_differently(runtime: Runtime) -> None:
    connection = await index(runtime, {"退保.txt": "退保手续费如何计算？", "贷款.txt": "保单贷款的利息按年计算。"})
    # jieba cuts the query into 退 / 保费 and the chunk into 退保 / 手续费: no word in common.
    assert await found(runtime, "退保费", connection, raw=False) == []
    assert await found(runtime, "退保费", connection) == ["退保.txt"]
    # The bigram field and its length are derived from the row by the trigger of migration 0004.
    row = await runtime.pool.fetchrow(
        "SELECT c.bigram_vector::text AS bigrams, c.bigram_count FROM chunks c JOIN documents d"
        " ON d.id = c.document_id WHERE d.connection_id = $1 AND d.source = '退保.txt'",
        connection,
    )
    assert row is not None
    assert "'退保'" in row["bigrams"] and "'算'" not in row["bigrams"]
    assert row["bigram_count"] == len("退保手续费如何计算") - 1


async def test_identifiers_are_found_whole(runtime: Runtime) -> None:
    connection = await index(
        runtime,
        {
            "target.txt": "Ticket PPR-9087 fixes the login timeout.",
            "same-prefix.txt": "Ticket PPR-1234 covers the dashboard. PPR tickets are triaged weekly by the PPR team.",
            "same-number.txt": "Order 9087 shipped on Monday.",
            "version.txt": "Upgrade to v1.2.3 before Friday.",
        },
    )
    assert (await found(runtime, "PPR-9087", connection))[0] == "target.txt"
    assert (await found(runtime, "what is ppr-9087 about", connection))[0] == "target.txt"
    assert (await found(runtime, "v1.2.3", connection))[0] == "version.txt"


async def test_scope_filters_and_permissions_apply_with_bm25(runtime: Runtime) -> None:
    shared = f"kw-{uuid.uuid4().hex[:12]}"
    await index(runtime, {"open.txt": "quasselbrot policy for everyone"}, connection=shared, knowledge_base="hr")
    await index(
        runtime,
        {"secret.txt": "quasselbrot salary bands"},
        connection=shared,
        acl=["group:finance"],
        knowledge_base="hr",
        metadata={"lang": "en"},
    )
    await index(runtime, {"elsewhere.txt": "quasselbrot elsewhere"}, connection=shared, knowledge_base="it")

    assert set(await found(runtime, "quasselbrot", shared)) == {"open.txt", "elsewhere.txt"}
    finance = Principal(user="ann", groups=["finance"])
    assert set(await found(runtime, "quasselbrot", shared, principal=finance)) == {
        "open.txt",
        "secret.txt",
        "elsewhere.txt",
    }
    # Every kind of filter at once: the BM25 statement numbers its own parameters after the scope's.
    filters = SearchFilters(
        connection_ids=[shared],
        platforms=["folder"],
        knowledge_bases=["hr"],
        sources=["secret.txt"],
        metadata={"lang": "en"},
    )
    assert await found(runtime, "quasselbrot", shared, filters=filters, principal=finance) == ["secret.txt"]
    assert await found(runtime, "quasselbrot", shared, filters=filters) == []
    other = SearchFilters(connection_ids=[f"kw-{uuid.uuid4().hex[:12]}"])
    assert await found(runtime, "quasselbrot", shared, filters=other) == []


async def test_odd_terms_and_stale_statistics_are_harmless(runtime: Runtime) -> None:
    connection = await index(runtime, {"a.txt": "zwieback toast"})
    store = SearchStore(runtime.pool, stats_ttl_s=3600)
    scope = Scope.build(SearchFilters(connection_ids=[connection]), None, first_param=3)
    # Quotes, backslashes and tsquery operators are data, not syntax.
    for terms in (["it's"], ["back\\slash"], ["a:b|c&d!(e)"], ["'"], ["zwieback", "o'clock\\"]):
        await store.keyword_leg(terms, 5, scope)
    assert await store.keyword_leg([], 5, scope) == []
    assert len(await store.keyword_leg(["zwieback"], 5, scope)) == 1
    # A cached chunk count older than the documents: df exceeds it, the scores stay finite.
    await index(runtime, {f"z{n}.txt": "zwieback crumbs" for n in range(30)}, connection=connection)
    store._cache.stats = _CorpusStats(time.monotonic(), 3.0, 4.0, 4.0)
    assert len(await store.keyword_leg(["zwieback", "toast"], 50, scope)) == 31
    [both] = await store.keyword_leg(["zwieback", "toast"], 1, scope)
    [toast] = await store.keyword_leg(["toast"], 1, scope)
    assert both.chunk_id == toast.chunk_id


def test_unknown_ranking_is_refused() -> None:
    with pytest.raises(ValueError):
        SearchStore(None, keyword_ranking="bm26")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SearchStore(None, bm25_b=1.5)
