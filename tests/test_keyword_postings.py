"""Impact-ordered postings (migration 0017, storage/postings.py) against a real PostgreSQL: the
keyword leg's top-10 from the postings equals the exact BM25 ranking across scopes, filters and
ACLs, also after the average lengths drifted; the postings and frequencies follow every write."""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import numpy as np
import pytest

from ragstream.messages import ChunkPayload, DocumentDeleted, DocumentHeader, IndexOutcome
from ragstream.retrieval import Principal, SearchFilters
from ragstream.runtime import Runtime, open_runtime
from ragstream.segmentation import query_terms
from ragstream.settings import Settings
from ragstream.storage.database import apply_migrations
from ragstream.storage.documents import document_id
from ragstream.storage.postings import (
    DOCUMENT_FILTERS,
    SELECTIVE_SCOPE,
    WHOLE_LISTS,
    ImpactOrderedPostings,
    refresh_impacts,
)
from ragstream.storage.scope import Scope
from ragstream.storage.search import SearchStore
from ragstream.storage.term_lists import Rescaling, TermLists
from tests.support.connections import private_database
from tests.support.plans import Explaining, nodes, rows_examined, rows_read, subplan

# The keyword leg's default BM25 parameters, which the postings' reference holds (migration 0023).
BM25 = {"bm25_k1": Settings.model_fields["bm25_k1"].default, "bm25_b": Settings.model_fields["bm25_b"].default}

pytestmark = pytest.mark.integration

# Invented words (so the stemmer keeps them apart) and common Chinese characters, drawn with a
# Zipf-like skew so that some terms sit in most chunks and others in a handful.
_SYLLABLES = ["ka", "lo", "mi", "ru", "te", "vo", "zan", "pel", "dor", "fis", "gun", "hep", "jab", "nix", "qor", "wez"]
_HANZI = "保险理赔费用合同条款退保贷款利息年金医疗意外身故责任等待期现金价值投保人受益人缴费宽限复效"


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) + "x")
    return sorted(words)


def _zipf_pick(rng: random.Random, items: Sequence[str]) -> str:
    return items[min(int(rng.paretovariate(0.9)) - 1, len(items) - 1)]


@dataclass
class Corpus:
    rng: random.Random
    words: list[str]
    chinese: float = 0.3  # the share of chunks and queries with Chinese text

    def text(self, length: int) -> str:
        parts = [_zipf_pick(self.rng, self.words) for _ in range(length)]
        if self.rng.random() < self.chinese:
            parts.append("".join(self.rng.choice(_HANZI) for _ in range(self.rng.randint(6, 30))))
        return " ".join(parts)

    def query(self) -> str:
        if self.rng.random() < self.chinese * 2 / 3:
            return "".join(self.rng.choice(_HANZI) for _ in range(self.rng.randint(3, 6)))
        common = [_zipf_pick(self.rng, self.words) for _ in range(self.rng.randint(1, 3))]
        rare = [self.rng.choice(self.words) for _ in range(self.rng.randint(1, 3))]
        return " ".join(common + rare)


async def _commit(
    runtime: Runtime,
    connection: str,
    name: str,
    texts: Sequence[str],
    *,
    acl: list[str] | None = None,
    knowledge_base: str = "",
    racing: bool = False,
) -> None:
    """One document of ``texts`` chunks through ``DocumentStore.commit_document`` (placeholder vectors).
    ``racing``: another commit of the document may carry a newer version and win."""
    dimension = runtime.embedder.dimension
    vectors = np.full((len(texts), dimension), 1 / np.sqrt(dimension), dtype=np.float32)
    header = DocumentHeader(
        document_id=document_id(connection, name),
        connection_id=connection,
        external_id=name,
        version=await runtime.store.next_version(),
        content_hash=hashlib.sha256("".join(texts).encode()).hexdigest(),
        title=name,
        source=name,
        media_type="text/plain",
        acl=acl,
        knowledge_base=knowledge_base,
    )
    chunks = [ChunkPayload(ordinal=n, heading="", text=text) for n, text in enumerate(texts)]
    outcome = await runtime.store.commit_document(header, chunks, vectors, runtime.embedder.model_key)
    assert outcome is IndexOutcome.INDEXED or (racing and outcome is IndexOutcome.STALE)


async def _build(runtime: Runtime, corpus: Corpus) -> dict[str, str]:
    """Four connections: open, split by knowledge base, ACL-checked, and ACL-skipping."""
    names = {role: f"kp-{role}-{uuid.uuid4().hex[:8]}" for role in ("open", "kb", "acl", "skip")}
    for connection in names.values():
        await runtime.store.ensure_connection(connection, "folder", connection)
    await runtime.pool.execute("UPDATE connections SET skip_acl = true WHERE id = $1", names["skip"])
    plan = [("open", 40, None, ""), ("kb", 24, None, "x"), ("kb", 16, None, "y")]
    plan += [("acl", 16, ["group:sec"], ""), ("skip", 16, ["group:sec"], "")]
    for role, documents, acl, knowledge_base in plan:
        for n in range(documents):
            texts = [corpus.text(corpus.rng.randint(15, 110)) for _ in range(corpus.rng.randint(3, 9))]
            name = f"{role}-{knowledge_base}-{n}"
            await _commit(runtime, names[role], name, texts, acl=acl, knowledge_base=knowledge_base)
    return names


async def _english_connection(
    runtime: Runtime, seed: int, words: int, documents: int, chunks: int, length: int
) -> tuple[Corpus, str]:
    """A connection of ``documents`` English documents of ``chunks`` chunks of ``length`` words."""
    corpus = Corpus(random.Random(seed), _vocabulary(random.Random(seed), words), chinese=0.0)
    connection = f"kp-{uuid.uuid4().hex[:8]}"
    await runtime.store.ensure_connection(connection, "folder", connection)
    for n in range(documents):
        await _commit(runtime, connection, f"doc-{n}", [corpus.text(length) for _ in range(chunks)])
    return corpus, connection


async def _assert_postings_match_chunks(pool: asyncpg.Pool) -> None:
    """The postings and frequencies are exactly those the chunks imply (and nothing else)."""
    postings = (
        "SELECT keyword_term(t.field, t.lexeme) AS term, t.field, least(t.tf, 32767)::smallint AS tf, c.posting_key"
        " FROM chunks c, keyword_chunk_terms(c.search_vector, c.bigram_vector) AS t"
    )
    stored = "SELECT term, field, tf, chunk_key FROM keyword_postings"
    frequencies = (
        "SELECT t.field, t.lexeme, d.connection_id, c.index_version, count(*)::int AS chunks,"
        " (count(*) FILTER (WHERE c.acl IS NOT NULL))::int AS restricted"
        " FROM chunks c JOIN documents d ON d.id = c.document_id,"
        " keyword_chunk_terms(c.search_vector, c.bigram_vector) AS t GROUP BY 1, 2, 3, 4"
    )
    counted = "SELECT field, lexeme, connection_id, index_version, chunks, restricted FROM keyword_df"
    for derived, kept in ((postings, stored), (frequencies, counted)):
        difference = await pool.fetchval(
            f"SELECT count(*) FROM (({derived}) EXCEPT ALL ({kept}) UNION ALL (({kept}) EXCEPT ALL ({derived}))) AS x"
        )
        assert difference == 0
    assert await pool.fetchval("SELECT count(*) FROM keyword_postings") > 0


async def _compare(
    pool: asyncpg.Pool,
    queries: Sequence[str],
    scopes: dict[str, tuple[SearchFilters, Principal | None]],
    whole_lists: TermLists | None = None,
) -> dict[str, dict[str, int]]:
    """Top-10 of the postings against the exact scan per scope; returns the paths each scope took.
    With ``whole_lists``, a search that reads 16 deep sums its terms' whole lists instead."""
    exact = SearchStore(pool, impact_ordered=False, **BM25)
    paths: dict[str, dict[str, int]] = {}
    shared = 0
    total = 0
    for label, (filters, principal) in scopes.items():
        # Every scope size and every round count gets exercised: no small-scope shortcut, shallow first reads.
        forced = ImpactOrderedPostings(
            exact_below=0,
            min_share=0.0,
            first_depth=4,
            max_read_share=1.0,
            max_scored=16,
            plan_from=16,
            whole_lists=whole_lists,
            lists_from=16,
        )
        fast = SearchStore(pool, postings=forced, **BM25)
        scope = Scope.build(filters, principal, first_param=3)
        for text in queries:
            terms = query_terms(text)
            want = await exact.keyword_leg(terms, 10, scope, query=text)
            async with fast.snapshot() as snapshot:  # whole lists are read in a search's snapshot only
                got = await snapshot.keyword_leg(terms, 10, scope, query=text)
            total += len(want)
            # A chunk tied with the last one kept (same score, up to the order of a float sum) may
            # take its place: the same ranking.
            kept = {hit.chunk_id for hit in want}
            shared += sum(hit.chunk_id in kept or hit.score == pytest.approx(want[-1].score, rel=1e-12) for hit in got)
            assert len(got) == len(want)
            for mine, theirs in zip(got, want, strict=True):
                assert mine.score == pytest.approx(theirs.score, rel=1e-9, abs=1e-12)
        paths[label] = dict(fast.keyword_paths)
    assert total > 0
    assert shared / total >= 0.99
    return paths


async def test_postings_rank_as_the_exact_scan_across_scopes_and_drift(runtime: Runtime, database_url: str) -> None:
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus = Corpus(random.Random(14), _vocabulary(random.Random(14), 300))
        names = await _build(own, corpus)
        await _assert_postings_match_chunks(own.pool)
        queries = [corpus.query() for _ in range(40)]
        secret = Principal(user="ann", groups=["sec"])
        scopes: dict[str, tuple[SearchFilters, Principal | None]] = {
            "open+kb": (SearchFilters(connection_ids=[names["open"], names["kb"]]), None),
            "one connection": (SearchFilters(connection_ids=[names["open"]]), None),
            "platform": (SearchFilters(platforms=["folder"], connection_ids=[names["open"], names["skip"]]), None),
            "skip_acl": (SearchFilters(connection_ids=[names["skip"]]), None),
            "acl": (SearchFilters(), secret),
            "acl, no principal": (SearchFilters(), None),
            "knowledge base": (SearchFilters(knowledge_bases=["x"]), None),
        }
        paths = await _compare(own.pool, queries, scopes)
        # The scopes the postings can serve exactly were served by them, the others scored exactly.
        for label in ("open+kb", "one connection", "platform", "skip_acl"):
            assert paths[label].get("postings", 0) >= 0.9 * len(queries), (label, paths[label])
        assert paths["knowledge base"] == {"exact: document filters": len(queries)}
        assert paths["acl"].get("exact: ACL", 0) >= 0.5 * len(queries), paths["acl"]
        # The same rankings from the terms' whole lists, loaded by the first search that reads deep
        # and then summed at once, before any round.
        lists = TermLists(64 << 20, reload_after_s=0)
        whole = await _compare(own.pool, queries, scopes, lists)
        for label in ("open+kb", "one connection", "platform", "skip_acl"):
            assert whole[label].get(WHOLE_LISTS, 0) >= 0.5 * len(queries), (label, whole[label])
        assert lists.loaded > 0

        # Long documents triple the average length: impacts stored under the old reference remain
        # valid bounds (scaled by the drift), so the ranking stays exact before any refresh.
        for n in range(12):
            await _commit(own, names["open"], f"long-{n}", [corpus.text(900) for _ in range(8)])
        before = await own.pool.fetchval("SELECT average_words FROM keyword_reference")
        now = await own.pool.fetchval("SELECT avg(lexeme_count)::float8 FROM chunks")
        assert now > 1.5 * before
        await _compare(own.pool, queries[:20], {"after drift": scopes["open+kb"]})
        # The lists kept were loaded before the commits: each term they changed is loaded again.
        loaded = lists.loaded
        drifted = await _compare(own.pool, queries[:20], {"after drift": scopes["open+kb"]}, lists)
        assert drifted["after drift"].get(WHOLE_LISTS, 0) >= 10 and lists.loaded > loaded
        assert await refresh_impacts(own.pool)
        assert await own.pool.fetchval("SELECT average_words FROM keyword_reference") == pytest.approx(now)
        stale = await own.pool.fetchval(
            "SELECT count(*) FROM keyword_postings p JOIN chunks c ON c.posting_key = p.chunk_key, keyword_reference r"
            " WHERE p.impact <> keyword_impact(p.tf::integer, CASE p.field WHEN 0 THEN c.lexeme_count"
            "  ELSE c.bigram_count END, CASE p.field WHEN 0 THEN r.average_words ELSE r.average_bigrams END, r.k1, r.b)"
        )
        assert stale == 0
        assert not await refresh_impacts(own.pool)
        await _compare(own.pool, queries[:20], {"after refresh": scopes["open+kb"]})
        await _compare(own.pool, queries[:20], {"after refresh": scopes["open+kb"]}, lists)


async def test_whole_lists_are_loaded_again_once_a_commit_changes_their_terms(
    runtime: Runtime, database_url: str
) -> None:
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus, connection = await _english_connection(own, 3, words=60, documents=30, chunks=4, length=40)
        common = corpus.words[0]  # the Zipf head: in most chunks
        lists = TermLists(64 << 20, reload_after_s=0)
        postings = ImpactOrderedPostings(exact_below=0, min_share=0.0, first_depth=4, whole_lists=lists, lists_from=4)
        store = SearchStore(own.pool, postings=postings, **BM25)
        scope = Scope.build(SearchFilters(connection_ids=[connection]), None, first_param=3)

        async def search() -> list[str]:
            async with store.snapshot() as snapshot:
                return [hit.chunk_id for hit in await snapshot.keyword_leg([common], 5, scope, query=common)]

        first = await search()
        assert store.keyword_paths[WHOLE_LISTS] == 1 and lists.loaded == 1
        assert await search() == first and lists.loaded == 1  # unchanged: summed from the list kept
        await _commit(own, connection, "new", [" ".join([common] * 30)])
        newest = await search()
        assert lists.loaded == 2 and newest[0] not in first  # the new chunk, the best of all, is found
        assert store.keyword_paths[WHOLE_LISTS] == 3
        # Changed again right after its load (a sync committing): the rounds answer, exactly, until
        # the list may be loaded again.
        lists.reload_after_s = 3600
        await _commit(own, connection, "newer", [" ".join([common] * 30)])
        newer = await search()
        assert lists.loaded == 2 and store.keyword_paths["postings"] == 1
        assert set(newer) - set(newest)  # the newer chunk is among the best


async def test_lists_loaded_ahead_answer_the_first_deep_search(runtime: Runtime, database_url: str) -> None:
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus, connection = await _english_connection(own, 3, words=60, documents=30, chunks=4, length=40)
        lists = TermLists(64 << 20)
        postings = ImpactOrderedPostings(exact_below=0, min_share=0.0, whole_lists=lists, lists_from=4)
        store = SearchStore(own.pool, postings=postings, **BM25)
        warmed = await store.warm_keyword_lists()
        assert warmed > 0 and lists.loaded == warmed
        common = corpus.words[0]  # the Zipf head: among the terms loaded ahead
        scope = Scope.build(SearchFilters(connection_ids=[connection]), None, first_param=3)
        async with store.snapshot() as snapshot:
            got = await snapshot.keyword_leg([common], 5, scope, query=common)
        assert dict(store.keyword_paths) == {WHOLE_LISTS: 1} and lists.loaded == warmed  # nothing loaded now
        want = await SearchStore(own.pool, impact_ordered=False, **BM25).keyword_leg([common], 5, scope, query=common)
        assert [hit.score for hit in got] == pytest.approx([hit.score for hit in want], rel=1e-9)


async def test_term_lists_keep_the_most_recently_used_within_their_budget(runtime: Runtime, database_url: str) -> None:
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        await _english_connection(own, 5, words=40, documents=20, chunks=3, length=30)
        terms = await own.pool.fetch(
            "SELECT term, count(*) AS postings FROM keyword_postings GROUP BY term ORDER BY 2 DESC LIMIT 3"
        )
        rescaling = Rescaling(0.4, 0.6, (10.0, 10.0), (10.0, 10.0))
        budget = TermLists.BYTES_PER_POSTING * (terms[0]["postings"] + terms[1]["postings"])
        lists = TermLists(budget)
        async with own.pool.acquire() as connection_:
            for row in (*terms[:2], terms[0], terms[2]):  # the first used again, then a third
                got = await lists.get(connection_, row["term"], 0, (1,), rescaling)
                assert len(got.keys) == row["postings"]
        assert lists.holds(terms[0]["term"], (1,), rescaling) and lists.holds(terms[2]["term"], (1,), rescaling)
        assert not lists.holds(terms[1]["term"], (1,), rescaling)  # the least recently used went
        assert not lists.holds(terms[0]["term"], (2,), rescaling)  # another version is another list
        assert lists.loaded == 3


@pytest.mark.parametrize(
    ("reference", "current"), [(120.0, 95.0), (95.0, 120.0), (300.0, 410.0), (100.0, 1000.0), (1000.0, 100.0)]
)
def test_rescaled_parts_bound_the_part_under_the_current_lengths(reference: float, current: float) -> None:
    k1, b = 0.4, 0.6
    rng = np.random.default_rng(4)
    tfs = rng.integers(1, 40, 4000)
    lengths = rng.integers(1, 3000, 4000).astype(np.float64)

    def part(average: float) -> np.ndarray:
        return tfs * (k1 + 1) / (tfs + k1 * (1 - b + b * lengths / average))

    stored = part(reference).astype(np.float32)  # as keyword_postings holds them
    exact = part(current)
    drifted = stored * max(1.0, current / reference)  # the rounds' bound of the same parts
    for field, averages in ((0, ((reference, 1.0), (current, 1.0))), (1, ((1.0, reference), (1.0, current)))):
        rescaled = Rescaling(k1, b, *averages).parts(stored, field)
        assert rescaled.dtype == np.float32
        assert np.all(rescaled * (1 + 1e-6) >= exact)  # a bound, with the search's rounding slack
        assert np.all(rescaled <= drifted * (1 + 1e-6))  # never looser than the stored impacts' bound
        if 0.5 < reference / current < 2:  # and a tight one for the drifts a corpus sees
            assert float(np.median(rescaled / exact)) < 1.03


async def test_postings_follow_edits_deletions_acls_and_concurrent_commits(runtime: Runtime, database_url: str) -> None:
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus = Corpus(random.Random(7), _vocabulary(random.Random(7), 120))
        connection = f"kp-{uuid.uuid4().hex[:8]}"
        other = f"kp-{uuid.uuid4().hex[:8]}"
        for name in (connection, other):
            await own.store.ensure_connection(name, "folder", name)
        for n in range(10):
            await _commit(own, connection, f"doc-{n}", [corpus.text(40) for _ in range(4)])
            await _commit(own, other, f"doc-{n}", [corpus.text(40) for _ in range(3)])
        await _assert_postings_match_chunks(own.pool)
        # Edits of the same documents from many tasks at once: each commit removes and adds
        # frequencies of one connection; none deadlocks and the counts stay exact.
        await asyncio.gather(
            *(
                _commit(own, connection, f"doc-{n % 10}", [corpus.text(40) for _ in range(5)], racing=True)
                for n in range(16)
            )
        )
        await _assert_postings_match_chunks(own.pool)
        deleted = DocumentDeleted(
            document_id=document_id(connection, "doc-3"),
            connection_id=connection,
            external_id="doc-3",
            source="doc-3",
            version=await own.store.next_version(),
        )
        assert await own.store.delete_document(deleted) is IndexOutcome.DELETED
        await own.store.update_acl(document_id(connection, "doc-4"), ["group:a"])
        await _assert_postings_match_chunks(own.pool)
        assert await own.pool.fetchval("SELECT sum(restricted) FROM keyword_df WHERE connection_id = $1", connection)
        await own.store.update_acl(document_id(connection, "doc-4"), None)
        await own.pool.execute("DELETE FROM connections WHERE id = $1", other)
        await _assert_postings_match_chunks(own.pool)
        left = "SELECT count(*) FROM keyword_df WHERE restricted > 0 OR connection_id = $1"
        assert not await own.pool.fetchval(left, other)


async def test_the_migration_backfills_an_existing_database(runtime: Runtime, database_url: str) -> None:
    async with private_database(database_url) as dsn:
        corpus = Corpus(random.Random(3), _vocabulary(random.Random(3), 150))
        async with open_runtime(runtime.settings, dsn) as own:
            connection = f"kp-{uuid.uuid4().hex[:8]}"
            await own.store.ensure_connection(connection, "folder", connection)
            for n in range(12):
                await _commit(own, connection, f"doc-{n}", [corpus.text(60) for _ in range(4)])
            # The database as it was before 0017: its objects gone, the migration not recorded.
            await own.pool.execute(
                "DROP TABLE keyword_postings, keyword_df, keyword_reference;"
                " DROP FUNCTION keyword_chunks_inserted, keyword_chunks_deleted, keyword_chunks_updated CASCADE;"
                " DROP FUNCTION keyword_apply, keyword_refresh_impacts, keyword_chunk_terms, keyword_impact,"
                "  keyword_term; DROP TYPE keyword_chunk;"
                " ALTER TABLE chunks DROP COLUMN posting_key;"
                " DELETE FROM schema_migrations"
                "  WHERE name IN ('0017_keyword_postings.sql', '0023_keyword_reference_defaults.sql')"
            )
        assert await apply_migrations(dsn) == ["0017_keyword_postings.sql", "0023_keyword_reference_defaults.sql"]
        async with open_runtime(runtime.settings, dsn) as own:
            await _assert_postings_match_chunks(own.pool)
            reference = await own.pool.fetchval("SELECT average_words FROM keyword_reference")
            assert reference == pytest.approx(await own.pool.fetchval("SELECT avg(lexeme_count)::float8 FROM chunks"))
            queries = [corpus.query() for _ in range(10)]
            await _compare(own.pool, queries, {"all": (SearchFilters(connection_ids=[connection]), None)})


async def test_an_english_only_corpus_is_served_from_the_postings(runtime: Runtime, database_url: str) -> None:
    # No chunk has bigrams, so the bigram field has no reference length: English queries need none.
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus, connection = await _english_connection(own, 5, words=150, documents=30, chunks=5, length=50)
        assert await own.pool.fetchval("SELECT average_bigrams FROM keyword_reference") is None
        queries = [corpus.query() for _ in range(15)]
        paths = await _compare(own.pool, queries, {"all": (SearchFilters(connection_ids=[connection]), None)})
        assert paths["all"] == {"postings": len(queries)}


async def test_a_selective_scope_is_scored_from_its_own_chunks(runtime: Runtime, database_url: str) -> None:
    """A scope holding a small share of the query terms' postings (a small connection beside large
    ones) takes the exact scan, which reads the scope's chunks first: the same ranking as scoring
    every match, without reading the matches of the rest of the corpus. A large scope whose terms sit
    elsewhere reads no more of its chunk ids than there are matches, then the matches."""
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus = Corpus(random.Random(23), _vocabulary(random.Random(23), 120))
        names = await _build(own, corpus)
        elsewhere = f"kp-elsewhere-{uuid.uuid4().hex[:8]}"
        await own.store.ensure_connection(elsewhere, "folder", elsewhere)
        for n in range(10):
            await _commit(own, elsewhere, f"elsewhere-{n}", [f"quuxword {corpus.text(20)}" for _ in range(5)])
        await _commit(own, names["open"], "one-quuxword", ["quuxword once in the large scope"])
        small = f"kp-small-{uuid.uuid4().hex[:8]}"
        await own.store.ensure_connection(small, "folder", small)
        for n in range(2):
            await _commit(own, small, f"small-{n}", [corpus.text(60) for _ in range(4)])
        await own.pool.execute("ANALYZE")
        scope = Scope.build(SearchFilters(connection_ids=[small]), None, first_param=3)
        exact = SearchStore(own.pool, impact_ordered=False, **BM25)
        selective = SearchStore(own.pool, **BM25)
        corpus_chunks = await own.pool.fetchval("SELECT count(*) FROM chunks")
        checked = 0
        for text in [corpus.query() for _ in range(20)]:
            terms = query_terms(text)
            async with own.pool.acquire() as raw:
                explaining = Explaining(raw)
                selective._db = explaining  # the statements of the leg, each explained before it runs
                got = await selective.keyword_leg(terms, 10, scope, query=text)
            want = await exact.keyword_leg(terms, 10, scope, query=text)
            assert [(hit.chunk_id, pytest.approx(hit.score, rel=1e-9)) for hit in got] == [
                (hit.chunk_id, hit.score) for hit in want
            ]
            if selective.keyword_paths.get(SELECTIVE_SCOPE, 0) > checked:
                checked += 1
                assert rows_read(explaining.plan, "chunks") <= 2 * 8 < corpus_chunks / 10  # 8 chunks in scope
        assert checked >= 15, dict(selective.keyword_paths)

        connections = [names["open"], names["kb"]]
        large = Scope.build(SearchFilters(connection_ids=connections), None, first_param=3)
        in_large = await own.pool.fetchval(
            "SELECT count(*) FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.connection_id = ANY($1)",
            connections,
        )
        before = selective.keyword_paths[SELECTIVE_SCOPE]
        async with own.pool.acquire() as raw:
            explaining = Explaining(raw)
            selective._db = explaining
            got = await selective.keyword_leg(["quuxword"], 10, large, query="quuxword")
        assert selective.keyword_paths[SELECTIVE_SCOPE] == before + 1
        want = await exact.keyword_leg(["quuxword"], 10, large, query="quuxword")
        assert [hit.chunk_id for hit in got] == [hit.chunk_id for hit in want] and len(got) == 1
        # 51 postings of quuxword in the corpus: the scope's ids are read up to 52, not all of them.
        assert rows_read(subplan(explaining.plan, "CTE in_scope"), "chunks") <= 53 < in_large


async def test_candidates_are_scored_beside_their_own_documents(runtime: Runtime, database_url: str) -> None:
    """The exact scoring of the chunks read from the postings looks up each one's document by its
    id: it never hashes every document, which at 195k documents scans them all for each statement."""
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus = Corpus(random.Random(31), _vocabulary(random.Random(31), 120))
        names = await _build(own, corpus)
        await own.pool.execute("ANALYZE")
        forced = ImpactOrderedPostings(exact_below=0, min_share=0.0, max_read_share=1.0)
        store = SearchStore(own.pool, postings=forced, **BM25)
        open_connections = SearchFilters(connection_ids=[names["open"], names["kb"], names["skip"]])
        scope = Scope.build(open_connections, None, first_param=3)
        scorings = 0
        for text in [corpus.query() for _ in range(10)]:
            async with own.pool.acquire() as raw:
                explaining = Explaining(raw)
                store._db = explaining
                await store.keyword_leg(query_terms(text), 10, scope, query=text)
            for plan in explaining.plans:
                if rows_read(plan, "documents"):
                    scorings += 1
                    hashes = [node for node in nodes(plan) if node["Node Type"] == "Hash"]
                    assert not [node for node in hashes if rows_read(node, "documents")]
        assert scorings >= 5, dict(store.keyword_paths)


async def test_a_narrow_document_filter_is_scored_from_its_own_chunks(runtime: Runtime, database_url: str) -> None:
    """A knowledge-base or source filter, whose in-scope df is not kept, takes the exact scan with the
    scope's own chunks first while they are fewer than the terms' postings in the corpus (migration
    0024 indexes the filtered columns): the ranking of scoring every match, without reading the
    matches of the rest of the corpus."""
    async with private_database(database_url) as dsn, open_runtime(runtime.settings, dsn) as own:
        corpus = Corpus(random.Random(29), _vocabulary(random.Random(29), 120))
        names = await _build(own, corpus)
        for n in range(2):
            texts = [corpus.text(60) for _ in range(4)]
            await _commit(own, names["open"], f"narrow-{n}", texts, knowledge_base="narrow")
        await own.pool.execute("ANALYZE")
        exact = SearchStore(own.pool, impact_ordered=False, **BM25)
        store = SearchStore(own.pool, **BM25)
        corpus_chunks = await own.pool.fetchval("SELECT count(*) FROM chunks")
        scope_first = 0
        for filters, in_scope in (
            (SearchFilters(knowledge_bases=["narrow"]), 8),
            (SearchFilters(sources=["narrow-1"]), 4),
        ):
            scope = Scope.build(filters, None, first_param=3)
            for text in [corpus.query() for _ in range(12)]:
                terms = query_terms(text)
                async with own.pool.acquire() as raw, raw.transaction():
                    # As on a large table: a tiny one is read whole, index or not.
                    await raw.execute("SET LOCAL enable_seqscan = off")
                    explaining = Explaining(raw)
                    store._db = explaining
                    got = await store.keyword_leg(terms, 10, scope, query=text)
                want = await exact.keyword_leg(terms, 10, scope, query=text)
                # The same ranking; chunks of equal scores may swap (their float sums differ in the last bits).
                assert [pytest.approx(hit.score, rel=1e-9) for hit in got] == [hit.score for hit in want]
                assert {hit.chunk_id for hit in got} == {hit.chunk_id for hit in want} or got[
                    -1
                ].score == pytest.approx(got[-2].score, rel=1e-9)
                if len(explaining.plans) > 1:  # the terms are in the corpus: the scan ran
                    # The scope's documents and chunks are found by indexes, not by reading the others.
                    finding = subplan(explaining.plan, "CTE in_scope")
                    assert rows_examined(finding, "documents") <= 2 and rows_examined(finding, "chunks") <= in_scope
                    # Fewer than the terms' postings in the corpus: only they are scored.
                    scope_first += rows_read(explaining.plan, "chunks") <= 2 * in_scope < corpus_chunks / 10
        assert store.keyword_paths[DOCUMENT_FILTERS] == 24
        assert scope_first >= 18, scope_first
