"""The two retrieval legs as SQL, both restricted by the same ``Scope``, and the chunk read-back."""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import asyncpg
import numpy as np

from ragstream.core.vectors import Block, Vectors
from ragstream.metrics import KEYWORD_SEARCHES
from ragstream.settings import BM25_B, BM25_BIGRAM_WEIGHT, BM25_K1
from ragstream.storage.database import DatabaseBusy
from ragstream.storage.postings import (
    BM25_SCORE,
    BM25_TERMS,
    Bm25Statistics,
    ImpactOrderedPostings,
    PostingsAnswer,
)
from ragstream.storage.scope import Scope
from ragstream.storage.sql import identifier

__all__ = ["ChunkRecord", "Hit", "KeywordRanking", "SearchStore", "SearchedSpace"]

KeywordRanking = Literal["bm25", "ts_rank"]

# A search's work_mem (its snapshot's SET LOCAL): what one sort or hash of a statement may hold before
# it spills to disk; a keyword leg's deep round of postings needs about 25 MB at a million chunks.
_SEARCH_WORK_MEM = "32MB"

# Each term is normalised by the same 'english' configuration the index used, then the terms are
# OR-ed: a question rarely contains every word of the paragraph that answers it.
_TSQUERY = """
    SELECT NULLIF(array_to_string(ARRAY(
        SELECT '(' || plainto_tsquery('english', term)::text || ')'
        FROM unnest($1::text[]) AS term
        WHERE plainto_tsquery('english', term)::text <> ''
    ), ' | '), '')::tsquery AS query
"""

# One row per (candidate chunk, field, matched lexeme) with its term frequency and the field length:
# - the candidates (``matched``, MATERIALIZED, carrying the chunk columns the scope clause and the
#   score read, ``Scope.build``), by one of two plans, each forced, since PostgreSQL misjudges the
#   scope's size (documents joined to a one-row connections table looked like 2 rows for 400):
#   ``_MATCHES_FIRST``, the chunks holding a query lexeme found by the GIN indexes, then checked
#   against the scope: O(matches); written as one join, the scope was planned first, reading every
#   chunk in scope and testing each with @@ (docs/benchmarks.md, "Hybrid search latency beside
#   LlamaIndex"). ``_SCOPE_FIRST``, for a scope holding a small share of the terms' postings
#   (``ImpactOrderedPostings.top``'s "exact: selective scope") and for document filters (a knowledge
#   base, a source: migration 0024 indexes them), where the other plan would read every match in the
#   corpus: the scope's chunk ids first, at most one more than the terms' postings in the
#   corpus (``{bound}``, which bounds the matches); when they are fewer, each is tested with @@:
#   O(scope); else (a large scope whose terms sit elsewhere) the matches first after all, having read
#   no more ids than matches. The unchosen branch's one-time filter is false, so it never runs;
# - tf: positions of the lexeme in the chunk (title and heading included, as in the vectors). The
#   vectors are first cut down to the query's lexemes in C (setweight on those lexemes, then
#   ts_filter on that weight): unnesting whole vectors costs about 6x more on InsuranceQA. The cut
#   drops the title/heading weight, so a heading match counts as much as a body match;
# - dl: chunks.lexeme_count / chunks.bigram_count, written with the vectors at index time.
_MATCHED_COLUMNS = """c.id, c.document_id, c.index_version, c.acl, c.lexeme_count, c.bigram_count,
               c.search_vector, c.bigram_vector"""
_MATCHES = "(c.search_vector @@ q.query OR c.bigram_vector @@ q.bigram_query)"
_MATCHES_FIRST = f"""
    matched AS MATERIALIZED (SELECT {_MATCHED_COLUMNS} FROM q, chunks c WHERE {_MATCHES}),"""
_SCOPE_FIRST = f"""
    in_scope AS MATERIALIZED (SELECT c.id FROM chunks c {{joins}} WHERE {{scope}} LIMIT {{bound}} + 1),
    small AS MATERIALIZED (SELECT count(*) <= {{bound}} AS scope_first FROM in_scope),
    matched AS MATERIALIZED (
        SELECT {_MATCHED_COLUMNS} FROM q, in_scope s JOIN chunks c ON c.id = s.id
        WHERE (SELECT scope_first FROM small) AND {_MATCHES}
        UNION ALL
        SELECT {_MATCHED_COLUMNS} FROM q, chunks c WHERE NOT (SELECT scope_first FROM small) AND {_MATCHES}),"""
_BM25_HITS = """
    WITH q AS MATERIALIZED ({terms}),{candidates}
    hits AS (
        SELECT c.id, h.field, CASE h.field WHEN 0 THEN c.lexeme_count ELSE c.bigram_count END AS dl,
               h.lexeme, greatest(h.tf, 1) AS tf
        FROM q, matched c {joins}, LATERAL (
            SELECT 0 AS field, m.lexeme, cardinality(m.positions) AS tf
            FROM unnest(ts_filter(setweight(c.search_vector, 'B', q.lexemes), '{{b}}')) AS m
            WHERE m.lexeme = ANY(q.lexemes)
            UNION ALL
            SELECT 1, m.lexeme, cardinality(m.positions)
            FROM unnest(ts_filter(setweight(c.bigram_vector, 'B', q.bigrams), '{{b}}')) AS m
            WHERE m.lexeme = ANY(q.bigrams)
        ) AS h
        WHERE {scope}
    )"""

# Okapi BM25 per field with Lucene's idf ln(1 + (N - df + 0.5) / (df + 0.5)), the bigram field's
# score weighted by bigram_weight and added to the words' (a sum of per-field BM25s):
# - df: the candidates that hold the lexeme, a window count. Every chunk in scope holding a query
#   lexeme is a candidate, so this is the exact document frequency *within the scope*, for free (no
#   extra index probe per lexeme), and chunks the caller may not see cannot shift the ranking;
# - N and the average field lengths: corpus-wide, from a briefly cached aggregate (_corpus_stats).
# The statement's own parameters follow the scope's ($3..), which both legs share.
_BM25 = (
    _BM25_HITS
    + """,
    counted AS (SELECT id, field, dl, tf, count(*) OVER (PARTITION BY field, lexeme)::float8 AS df FROM hits),
    p AS (SELECT ${k1}::float8 AS k1, ${b}::float8 AS b, ${n}::float8 AS n, ${avg_words}::float8 AS avg_words,
                 ${avg_bigrams}::float8 AS avg_bigrams, ${bigram_weight}::float8 AS bigram_weight)
    SELECT id, {score} AS score
    FROM counted, p
    GROUP BY id
    ORDER BY score DESC, id
    LIMIT $2
"""
)


class Hit(NamedTuple):
    """One chunk a leg found, with the leg's own score (higher is better): cosine similarity for the
    vector leg, BM25 (or ts_rank_cd) for the keyword leg. Score fusion needs the values, RRF only the order."""

    chunk_id: str
    score: float


@dataclass(frozen=True, slots=True)
class _CorpusStats:
    taken_at: float
    chunks: float
    average_words: float
    average_bigrams: float


@dataclass(slots=True)
class _StatsCache:
    """Shared by a store and its snapshots, so a snapshot's fresh statistics serve the next search."""

    stats: _CorpusStats | None = None


@dataclass(frozen=True, slots=True)
class SearchedSpace:
    """An embedding space a search runs a vector leg in, as its snapshot sees it. ``active``: the
    deployment's default space, which the connections not pinned to a model use."""

    model_key: str
    table: str
    spec: dict[str, Any] | None
    active: bool
    # The space's own fusion weights (``embedding_spaces.fusion``), None when it has none.
    fusion: dict[str, Any] | None = None


# The effective spaces (pinned, else active) of the searchable connections in scope ($1: the scope's
# connection ids, NULL for all), the active one first; the active space alone when no connection is
# in scope, as before connections had models. A few rows of a small table: one cheap statement.
_SEARCHED_SPACES = """
    WITH effective AS (
        SELECT DISTINCT coalesce(k.embedding_model_key,
                                 (SELECT model_key FROM embedding_spaces WHERE status = 'active')) AS model_key
        FROM connections k
        WHERE k.status = 'active' AND k.rag_enabled AND ($1::text[] IS NULL OR k.id = ANY($1::text[])))
    SELECT s.model_key, s.table_name, s.spec, s.fusion, s.status = 'active' AS active FROM embedding_spaces s
    WHERE s.model_key IN (SELECT model_key FROM effective)
       OR (s.status = 'active' AND NOT EXISTS (SELECT 1 FROM effective))
    ORDER BY s.status = 'active' DESC, s.model_key
"""


def _scope_probe(scope: Scope, chunk_id: str = "ca.chunk_id") -> str:
    """The chunk ``chunk_id`` if the scope lets it through, read by primary key: its chunk row, then its
    document's, then its connection's, one index probe each.

    The vector leg (and ``similarities``) joins its candidates to this subquery LATERALly, and each
    LIMIT keeps the planner from flattening it into an ordinary join. Flattened, the join was planned
    against the whole scope: on a freshly ingested corpus (no statistics yet, so every table looks
    like one row) and whenever it believes a scope small, PostgreSQL read every visible chunk (all
    documents of the connection, then all of their chunks) to keep the ``ef_search`` candidates: the leg cost
    O(corpus) instead of O(ef_search) (docs/vector-leg.md, "What the vector leg cost")."""
    return (
        f"SELECT c.id FROM chunks c,"
        " LATERAL (SELECT * FROM documents WHERE id = c.document_id LIMIT 1) AS d,"
        " LATERAL (SELECT * FROM connections WHERE id = d.connection_id LIMIT 1) AS k"
        f" WHERE c.id = {chunk_id} AND {scope.sql} LIMIT 1"
    )


def _jsonb(value: Any) -> Any:
    """A jsonb column as Python (asyncpg hands jsonb over as text without a codec)."""
    return json.loads(value) if isinstance(value, str) else value


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    chunk_id: str
    document_id: str
    connection_id: str
    platform: str
    knowledge_base: str
    title: str
    source: str
    url: str | None
    heading: str
    text: str
    # The model of the connection's effective space (pinned, else the active one).
    embedding_space: str | None


class SearchStore:
    """The SQL of both legs.

    ``keyword_ranking`` orders the keyword leg by Okapi BM25 computed in SQL over words and CJK
    bigrams (``bm25_k1``, ``bm25_b``, ``bigram_weight``), or by PostgreSQL's ``ts_rank_cd`` over
    words (``"ts_rank"``). ``docs/retrieval-quality.md`` has the measurements behind the defaults.
    ``impact_ordered``: BM25 reads the impact-ordered postings (``storage/postings.py``) where they
    give the exact ranking, and scores every matching chunk otherwise; ``False`` always does the latter.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        ef_search: int = 100,
        keyword_ranking: KeywordRanking = "bm25",
        bm25_k1: float = BM25_K1,
        bm25_b: float = BM25_B,
        bigram_weight: float = BM25_BIGRAM_WEIGHT,
        stats_ttl_s: float = 300.0,
        statement_timeout_s: float | None = None,
        impact_ordered: bool = True,
        postings: ImpactOrderedPostings | None = None,
    ) -> None:
        if keyword_ranking not in ("bm25", "ts_rank"):
            raise ValueError(f"unknown keyword ranking {keyword_ranking!r}")
        if bm25_k1 < 0 or not 0 <= bm25_b <= 1 or bigram_weight < 0:
            raise ValueError("BM25 needs k1 >= 0, 0 <= b <= 1 and bigram_weight >= 0")
        self._pool = pool
        self._db: Any = pool  # the pool, or in a snapshot its one connection
        self._ef_search = ef_search
        self._keyword_ranking = keyword_ranking
        self._bm25 = (float(bm25_k1), float(bm25_b), float(bigram_weight))
        self._stats_ttl_s = stats_ttl_s
        self._cache = _StatsCache()
        self._timeout_ms = round(statement_timeout_s * 1000) if statement_timeout_s else 0
        self._impact_ordered = impact_ordered
        self._postings = postings or ImpactOrderedPostings()
        # How many BM25 searches each path answered (``postings``, or ``exact: <why>``), shared with
        # the snapshots: what a benchmark reports next to its latencies.
        self.keyword_paths: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[SearchStore]:
        """This store on one connection, in one read-only REPEATABLE READ transaction: every statement
        of a search then sees the same committed state, so a re-chunk switch or a deletion committed
        meanwhile is seen by all of them or by none, never by one leg and not the other, and the
        read-back finds every chunk the legs returned.

        The snapshot is the search's only pool connection: nothing in the block may acquire another,
        or searches holding every connection would each wait for one more. With
        ``statement_timeout_s``, a statement (the lock wait included) or a pause between statements
        that runs longer ends the snapshot with :class:`DatabaseBusy`."""
        try:
            async with (
                self._pool.acquire() as connection,
                connection.transaction(isolation="repeatable_read", readonly=True),
            ):
                if self._timeout_ms:
                    await connection.execute(
                        f"SET LOCAL statement_timeout = {self._timeout_ms};"
                        f" SET LOCAL idle_in_transaction_session_timeout = {self._timeout_ms}"
                    )
                # chunks first, as the re-index switch does before it drops a table that references it:
                # a search holding an embedding table while waiting for chunks would deadlock with it.
                # The keyword leg's deep rounds hold a few hundred thousand postings, which the
                # server's default work_mem (4 MB) would write to disk.
                await connection.execute(
                    f"SET LOCAL work_mem = '{_SEARCH_WORK_MEM}'; LOCK TABLE chunks IN ACCESS SHARE MODE"
                )
                bound = copy.copy(self)
                bound._db = connection
                yield bound
        except (asyncpg.QueryCanceledError, asyncpg.IdleInTransactionSessionTimeoutError) as error:
            raise DatabaseBusy(f"a search statement ran past {self._timeout_ms} ms") from error
        except (asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError) as error:
            # The server ended the snapshot's session (its idle timeout, a restart): the search may be
            # asked again, like a busy database, rather than fail as an error of its own.
            raise DatabaseBusy(f"the search's database session ended: {error}") from error

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Any]:
        """Where ``SET LOCAL`` is safe: a transaction of its own, or a savepoint within a snapshot."""
        if self._db is self._pool:
            async with self._pool.acquire() as connection, connection.transaction():
                yield connection
        else:
            async with self._db.transaction():
                yield self._db

    async def embedding_table(self, model_key: str) -> str | None:
        space = await self.space(model_key)
        return space.table if space is not None else None

    async def space(self, model_key: str) -> SearchedSpace | None:
        """The space of one model, whatever its role (``active`` says whether it is the default)."""
        row = await self._db.fetchrow(
            "SELECT table_name, spec, fusion, status = 'active' AS active FROM embedding_spaces WHERE model_key = $1",
            model_key,
        )
        if row is None:
            return None
        spec, fusion = (
            json.loads(value) if isinstance(value, str) else value for value in (row["spec"], row["fusion"])
        )
        return SearchedSpace(model_key, row["table_name"], spec, row["active"], fusion)

    async def searched_spaces(self, connection_ids: Sequence[str] | None) -> list[SearchedSpace]:
        """The spaces whose vector legs cover the connections in scope (``_SEARCHED_SPACES``)."""
        rows = await self._db.fetch(_SEARCHED_SPACES, list(connection_ids) if connection_ids is not None else None)
        return [
            SearchedSpace(
                row["model_key"], row["table_name"], _jsonb(row["spec"]), row["active"], _jsonb(row["fusion"])
            )
            for row in rows
        ]

    # pgvector 0.6 filters after the HNSW scan: a scan of ef_search nodes yields at most ef_search
    # candidates, and only the share the scope lets through survives. So the leg measures that share
    # near the query, widens the scan to keep about ef_search visible candidates, and scans the scoped
    # rows exactly when no ef_search pgvector accepts would do (docs/vector-leg.md has the numbers).
    # pgvector 0.8's iterative index scans also fill a scope, but with a lower recall (0.74 to 0.97
    # against 0.99 to 1.00 at 5 % and 20 % scopes), so this policy stays on pgvector 0.8 too.
    _EF_MAX = 1000  # upper bound of hnsw.ef_search (pgvector 0.6 and 0.8)
    _EF_SLACK = 1.25  # a first scan within this factor of the ef_search it needed is kept

    async def vector_leg(
        self, table: str, query_vector: Vectors, limit: int, scope: Scope, block: Block | None = None
    ) -> list[Hit]:
        """Ids of the ``limit`` chunks nearest to the query within the scope, fewer only when the
        scope holds fewer: however selective the scope, the leg never comes back short. With ``block``,
        nearest by that block of the vectors (``query_vector`` is the block's part), through its index."""
        vector = np.asarray(query_vector, dtype=np.float32)
        column = block.sql("e.embedding") if block is not None else "e.embedding"
        base = min(max(self._ef_search, limit), self._EF_MAX)
        async with self._transaction() as connection:
            hits, visible, seen = await self._hnsw_scan(connection, table, column, vector, limit, scope, base)
            if len(hits) == limit and visible * self._EF_SLACK >= base:
                return hits
            # Fewer than half the candidates asked for: a small table (or one full of dead rows not
            # vacuumed yet), where widening the scan cannot help and the exact scan is cheap.
            if seen * 2 >= base:
                # ef_search at which about ``base`` candidates would be visible, at the share seen.
                wanted = -(-base * base // visible) if visible else self._EF_MAX + 1
                if wanted <= self._EF_MAX:
                    hits, _, _ = await self._hnsw_scan(connection, table, column, vector, limit, scope, wanted)
                    if len(hits) == limit:
                        return hits
            return await self._exact_scan(connection, table, column, vector, limit, scope)

    @staticmethod
    async def _hnsw_scan(
        connection: asyncpg.Connection, table: str, column: str, vector: np.ndarray, limit: int, scope: Scope, ef: int
    ) -> tuple[list[Hit], int, int]:
        """The nearest visible chunks among the ``ef`` the index yields, how many of those were
        visible, and how many it yielded (fewer than ``ef`` when the table is small)."""
        await connection.execute(f"SET LOCAL hnsw.ef_search = {ef}")
        row = await connection.fetchrow(
            f"WITH candidates AS MATERIALIZED (SELECT e.chunk_id, {column} <=> $1 AS distance"
            f" FROM {identifier(table)} e"
            f"  ORDER BY {column} <=> $1 LIMIT {ef}),"
            f" visible AS (SELECT v.id, ca.distance FROM candidates ca CROSS JOIN LATERAL ({_scope_probe(scope)}) AS v)"
            " SELECT (SELECT count(*) FROM candidates) AS seen, (SELECT count(*) FROM visible) AS visible,"
            " ARRAY(SELECT ROW(id, 1 - distance) FROM visible ORDER BY distance, id LIMIT $2) AS hits",
            vector,
            limit,
            *scope.params,
        )
        assert row is not None
        return [Hit(*hit) for hit in row["hits"]], int(row["visible"]), int(row["seen"])

    @staticmethod
    async def _exact_scan(
        connection: asyncpg.Connection, table: str, column: str, vector: np.ndarray, limit: int, scope: Scope
    ) -> list[Hit]:
        """Distances to every scoped chunk: computed in a CTE so no index can answer the ORDER BY."""
        rows = await connection.fetch(
            f"WITH scoped AS MATERIALIZED (SELECT c.id, {column} <=> $1 AS distance FROM {identifier(table)} e"
            f"  JOIN chunks c ON c.id = e.chunk_id {scope.joins} WHERE {scope.sql})"
            " SELECT id, 1 - distance AS score FROM scoped ORDER BY distance, id LIMIT $2",
            vector,
            limit,
            *scope.params,
        )
        return [Hit(row["id"], row["score"]) for row in rows]

    async def similarities(
        self,
        table: str,
        query_vector: Vectors,
        chunk_ids: Sequence[str],
        scope: Scope | None = None,
        block: Block | None = None,
    ) -> dict[str, float]:
        """Cosine similarity of the query to each of ``chunk_ids`` that has a vector in ``table``:
        score fusion needs it for the keyword leg's chunks that the vector leg did not return. With
        ``scope`` (numbered from $3), only those of its chunks: a table holds the vectors a re-index
        is building for connections that another leg covers. With ``block``, by that block."""
        column = block.sql("e.embedding") if block is not None else "e.embedding"
        if scope is None:
            sql = (
                f"SELECT e.chunk_id, 1 - ({column} <=> $1) AS score FROM {identifier(table)} e"
                " WHERE e.chunk_id = ANY($2::text[])"
            )
        else:
            sql = (
                f"SELECT e.chunk_id, 1 - ({column} <=> $1) AS score FROM {identifier(table)} e"
                f" CROSS JOIN LATERAL ({_scope_probe(scope, 'e.chunk_id')}) AS v WHERE e.chunk_id = ANY($2::text[])"
            )
        rows = await self._db.fetch(
            sql,
            np.asarray(query_vector, dtype=np.float32),
            list(chunk_ids),
            *(scope.params if scope is not None else ()),
        )
        return {row["chunk_id"]: row["score"] for row in rows}

    async def keyword_leg(
        self, terms: Sequence[str], limit: int, scope: Scope, *, query: str | None = None
    ) -> list[Hit]:
        """The best ``limit`` chunks in the scope holding at least one of the terms.

        ``terms`` are the query's words (``segmentation.query_terms``). ``query``, the raw text they
        came from, adds its Chinese character bigrams to the BM25 ranking; without it, BM25 ranks by
        the words alone.
        """
        if not terms:
            return []
        if self._keyword_ranking == "ts_rank":
            rows = await self._db.fetch(
                f"WITH q AS ({_TSQUERY}) SELECT c.id, ts_rank_cd(c.search_vector, q.query) AS score"
                f" FROM q, chunks c {scope.joins}"
                f" WHERE q.query IS NOT NULL AND c.search_vector @@ q.query AND {scope.sql}"
                " ORDER BY score DESC, c.id LIMIT $2",
                list(terms),
                limit,
                *scope.params,
            )
            return [Hit(row["id"], row["score"]) for row in rows]
        stats = await self._corpus_stats()
        k1, b, bigram_weight = self._bm25
        values = {
            "text": query,
            "k1": k1,
            "b": b,
            "n": stats.chunks,
            "avg_words": stats.average_words,
            "avg_bigrams": stats.average_bigrams,
            "bigram_weight": bigram_weight,
        }
        if self._impact_ordered:
            answer = await self._from_postings(terms, limit, scope, query, stats)
            self.keyword_paths[answer.path] += 1
            KEYWORD_SEARCHES.labels(answer.path).inc()
            if answer.hits is not None:
                return [Hit(*hit) for hit in answer.hits]
            if answer.corpus_postings:  # a selective scope, document filters: the scope first
                values["bound"] = answer.corpus_postings
        first = 3 + len(scope.params)
        numbers = {name: first + offset for offset, name in enumerate(values)}
        candidates = _MATCHES_FIRST
        if "bound" in numbers:  # a parameter, not a literal: one prepared statement serves every bound
            candidates = _SCOPE_FIRST.format(
                joins=scope.joins, scope=scope.sql, bound=f"${numbers.pop('bound')}::bigint"
            )
        terms_sql = BM25_TERMS.format(text=numbers.pop("text"))
        rows = await self._db.fetch(
            _BM25.format(
                terms=terms_sql, candidates=candidates, joins=scope.joins, scope=scope.sql, score=BM25_SCORE, **numbers
            ),
            list(terms),
            limit,
            *scope.params,
            *values.values(),
        )
        return [Hit(row["id"], row["score"]) for row in rows]

    async def _from_postings(
        self, terms: Sequence[str], limit: int, scope: Scope, query: str | None, stats: _CorpusStats
    ) -> PostingsAnswer:
        """The BM25 top-k read from the impact-ordered postings (``ImpactOrderedPostings``), or the
        path of the exact scan this query and scope need."""
        return await self._postings.top(self._db, terms, query, limit, scope, self._statistics(stats))

    def _statistics(self, stats: _CorpusStats) -> Bm25Statistics:
        k1, b, bigram_weight = self._bm25
        return Bm25Statistics(k1, b, bigram_weight, stats.chunks, stats.average_words, stats.average_bigrams)

    async def warm_keyword_lists(self) -> int:
        """Load the whole term lists that the first deep keyword searches would load
        (``ImpactOrderedPostings.warm``), in one snapshot; returns how many. For a retriever's start."""
        if not self._impact_ordered or self._keyword_ranking != "bm25":
            return 0
        async with self.snapshot() as snapshot:
            statistics = self._statistics(await snapshot._corpus_stats())
            return await self._postings.warm(snapshot._db, statistics)

    async def _corpus_stats(self) -> _CorpusStats:
        """Number of chunks and average field lengths, at most ``stats_ttl_s`` old.

        They only normalise scores and move slowly as documents come and go, so a few minutes of
        staleness does not change a ranking noticeably, while reading them on every search would
        scan an index of every chunk per query. Corpus-wide on purpose: an aggregate over all chunks
        says nothing about any one chunk a caller may not see. The bigram average is over chunks
        that have bigrams: English chunks have none and would make every Chinese chunk look long.
        """
        now = time.monotonic()
        cached = self._cache.stats
        if cached is None or now - cached.taken_at > self._stats_ttl_s:
            row = await self._db.fetchrow(
                "SELECT count(*) AS n, avg(lexeme_count)::float8 AS words,"
                " avg(bigram_count) FILTER (WHERE bigram_count > 0)::float8 AS bigrams FROM chunks"
            )
            assert row is not None
            cached = self._cache.stats = _CorpusStats(now, float(row["n"]), row["words"] or 1.0, row["bigrams"] or 1.0)
        return cached

    async def chunks(self, chunk_ids: Sequence[str]) -> dict[str, ChunkRecord]:
        rows = await self._db.fetch(
            "SELECT c.id, c.document_id, d.connection_id, k.platform, d.knowledge_base, d.title, d.source, d.url,"
            " c.heading, c.text, coalesce(k.embedding_model_key,"
            "  (SELECT model_key FROM embedding_spaces WHERE status = 'active')) AS embedding_space"
            " FROM chunks c JOIN documents d ON d.id = c.document_id"
            " JOIN connections k ON k.id = d.connection_id WHERE c.id = ANY($1::text[])",
            list(chunk_ids),
        )
        return {
            row["id"]: ChunkRecord(
                row["id"],
                row["document_id"],
                row["connection_id"],
                row["platform"],
                row["knowledge_base"],
                row["title"],
                row["source"],
                row["url"],
                row["heading"],
                row["text"],
                row["embedding_space"],
            )
            for row in rows
        }
