"""The keyword leg's BM25 top-k from impact-ordered postings, without scoring every matching chunk.

Migration 0017 keeps, per (field, lexeme), the chunks holding it ordered by their BM25 term-frequency
part (``impact``, under reference lengths), and the exact document frequency per connection and
index version. A search reads the best postings of each query term (``first_depth`` of each list at
first), bounds the score of every chunk read (MaxScore-style: its impacts read, and for each list
not read to the end the last impact read, each times weight × idf × drift) and scores exactly, with
the same SQL expression as the exact path and the in-scope df, first the chunks whose impacts read
weigh most (their ``limit``-th exact score is the threshold), then only the chunks whose bound
reaches the threshold. It stops once the threshold beats the bound of every unread chunk and those
chunks are few enough; else it reads deeper (4×) in the lists that keep the bounds high, and past
``max_depth`` hands back to the exact path; a search that reads deep sums its terms' whole lists,
kept in memory, instead (``storage/term_lists.py``, ``_from_whole_lists``). ``drift`` is max(1,
current average length / reference average length): the term-frequency part grows with the average
length and by at most that ratio, so impacts stored under older statistics stay valid bounds. The
result is the exact BM25 top-k, with the same scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import asyncpg
import numpy as np
import numpy.typing as npt

from ragstream.storage.term_lists import Rescaling, TermLists, list_version

if TYPE_CHECKING:
    from ragstream.storage.scope import Scope

__all__ = [
    "BM25_SCORE",
    "BM25_TERMS",
    "DOCUMENT_FILTERS",
    "SELECTIVE_SCOPE",
    "WHOLE_LISTS",
    "Bm25Statistics",
    "ImpactOrderedPostings",
    "PostingsAnswer",
    "refresh_impacts",
]

# The BM25 sum of a chunk over its (field, lexeme, tf, dl, df) rows, given p(k1, b, n, avg_words,
# avg_bigrams, bigram_weight). Shared with the exact path so that both compute identical scores.
BM25_SCORE = """sum(CASE field WHEN 0 THEN 1 ELSE p.bigram_weight END
                   * ln(1 + (greatest(p.n, df) - df + 0.5) / (df + 0.5)) * tf * (p.k1 + 1)
                   / (tf + p.k1 * (1 - p.b + p.b * dl / CASE field WHEN 0 THEN p.avg_words ELSE p.avg_bigrams END))
               )"""

# The query's terms, shared with the exact path (storage/search.py). BM25 scores single lexemes of
# two fields:
# - words (search_vector): the query's lexemes under the index's normalisation (stemmed English,
#   jieba words, identifiers);
# - CJK character bigrams (bigram_vector, migration 0004) of the raw query text, when the caller
#   passes it: they match Chinese that jieba cut differently in the query and in the chunk.
# Each lexeme is quoted as a one-lexeme tsquery (quotes and backslashes doubled) and all are OR-ed,
# so that the GIN indexes find every chunk holding at least one of them. MATERIALIZED: inlined, the
# normalisation would run again for every candidate row.
_OR_QUERY = r"""NULLIF(array_to_string(ARRAY(
        SELECT '''' || replace(replace(lexeme, '\', '\\'), '''', '''''') || ''''
        FROM unnest({lexemes}) AS lexeme
    ), ' | '), '')::tsquery"""
BM25_TERMS = f"""
    SELECT lexemes, {_OR_QUERY.format(lexemes="lexemes")} AS query,
           bigrams, {_OR_QUERY.format(lexemes="bigrams")} AS bigram_query
    FROM (SELECT tsvector_to_array(to_tsvector('english', array_to_string($1::text[], ' '))) AS lexemes,
                 tsvector_to_array(to_tsvector('simple', cjk_bigrams(coalesce(${{text}}::text, '')))) AS bigrams) AS t
"""

# The query's (field, lexeme) pairs as CTEs ``t`` (BM25_TERMS) and ``q``: field 0 the words, 1 the
# bigrams. $1/$2: the query's words and raw text.
_QUERY_TERMS = f"""
    t AS MATERIALIZED ({BM25_TERMS.format(text=2)}),
    q AS (SELECT 0::smallint AS field, lexeme FROM t, unnest(t.lexemes) AS lexeme
          UNION ALL SELECT 1::smallint, lexeme FROM t, unnest(t.bigrams) AS lexeme)"""

# In one statement (one round trip): the query's lexemes and bigrams (BM25_TERMS), the reference
# statistics the impacts were stored under (keyword_reference), each term's in-scope document
# frequency from keyword_df, read through the caller's scope clause, and the versions of its rows and
# of the reference (the transactions that wrote them, comma-separated: asyncpg reads no array in a
# record; storage/term_lists.py): keyword_df stands in for the
# chunks (``c``: its index_version, no ACL), a row with the connection for the document (``d``). Only
# valid for scopes without document filters (Scope.document_filters); ``restricted`` counts chunks
# with an ACL in connections that check it, which only an exact scan can judge. $1/$2: the query's
# words and raw text; the scope's parameters from $3.
_FREQUENCIES = f"""
    WITH {_QUERY_TERMS},
    scoped AS (
        SELECT c.field, c.lexeme, c.chunks, CASE WHEN k.skip_acl THEN 0 ELSE c.restricted END AS restricted
        FROM (SELECT f.*, NULL::text[] AS acl FROM keyword_df f JOIN q USING (field, lexeme)) AS c
        JOIN connections k ON k.id = c.connection_id
        CROSS JOIN LATERAL (SELECT 'indexed'::text AS status, c.connection_id) AS d
        WHERE {{scope}}),
    frequencies AS (
        SELECT q.field, q.lexeme, keyword_term(q.field, q.lexeme) AS term,
               coalesce((SELECT sum(s.chunks) FROM scoped s WHERE s.field = q.field AND s.lexeme = q.lexeme), 0)::float8
                   AS df,
               coalesce((SELECT sum(s.restricted) FROM scoped s WHERE s.field = q.field AND s.lexeme = q.lexeme), 0)
                   AS restricted,
               coalesce((SELECT sum(f.chunks) FROM keyword_df f WHERE f.field = q.field AND f.lexeme = q.lexeme),
                        0)::float8 AS everywhere,
               array_to_string(ARRAY(SELECT f.xmin::text FROM keyword_df f
                                     WHERE f.field = q.field AND f.lexeme = q.lexeme), ',') AS versions
        FROM q)
    SELECT t.lexemes, t.bigrams, r.k1, r.b, r.average_words, r.average_bigrams,
           r.xmin::text::bigint AS reference_version,
           ARRAY(SELECT ROW(field, lexeme, term, df, restricted, everywhere, versions) FROM frequencies) AS terms
    FROM t LEFT JOIN keyword_reference r ON true
"""

# The corpus's most frequent terms ($1 of them, among those with over $2 chunks in one connection and
# index version: a scan of keyword_df's rows, not an aggregate of all of them), with the postings and
# the versions of their whole lists (``ImpactOrderedPostings.warm``).
_FREQUENT_TERMS = """
    WITH frequent AS (
        SELECT field, lexeme, sum(chunks) AS chunks FROM keyword_df WHERE chunks > $2
        GROUP BY field, lexeme ORDER BY chunks DESC LIMIT $1)
    SELECT q.field, keyword_term(q.field, q.lexeme) AS term,
           (SELECT sum(f.chunks) FROM keyword_df f WHERE f.field = q.field AND f.lexeme = q.lexeme)::float8 AS postings,
           array_to_string(ARRAY(SELECT f.xmin::text FROM keyword_df f
                                 WHERE f.field = q.field AND f.lexeme = q.lexeme), ',') AS versions
    FROM frequent q ORDER BY postings DESC
"""
_REFERENCE = "SELECT *, xmin::text::bigint AS reference_version FROM keyword_reference"

# How many postings the query's terms have in the whole corpus (every connection and index
# version): a bound of the chunks matching them. $1/$2: the query's words and raw text.
_CORPUS_POSTINGS = f"""
    WITH {_QUERY_TERMS}
    SELECT coalesce(sum(f.chunks), 0)::bigint FROM q JOIN keyword_df f USING (field, lexeme)
"""

# The impact at depth ``t.depth`` of term ``t.term``'s list (NULL past its end): a short index scan.
_IMPACT_AT_DEPTH = """(SELECT impact FROM keyword_postings p WHERE p.term = t.term
                       ORDER BY impact DESC OFFSET t.depth - 1 LIMIT 1)"""

# One round of reading: the best postings of each term (an index range scan each, as deep as that
# term's depth) and per chunk read an upper bound of its score: its impacts read times the terms'
# bounds, plus for each other list not read to the end (``rest``: the bound times the impact at the
# list's depth, found by its own short index scan; NULL once the list ends within its depth) the bound
# times that last impact. Returned: each list's rest; the bound of an unread chunk; the $6 chunks
# whose impacts read weigh most (likely the best: scored first, they set the threshold); how many
# chunks have an upper bound of at least $4 (the threshold so far), and the first $5 of them by that
# bound. Only those leave the server: a deep round reads hundreds of thousands of postings, in one
# pass into one hash aggregate. $1: term keys, $2: depths, $3: bounds (weight × idf × drift × slack).
_READ = f"""
    WITH t AS MATERIALIZED (
        SELECT t.*, t.bound * {_IMPACT_AT_DEPTH} AS rest
        FROM unnest($1::bigint[], $2::int[], $3::float8[]) WITH ORDINALITY AS t(term, depth, bound, ordinal)),
    unread AS (SELECT coalesce(sum(rest), 0)::float8 AS bound FROM t),
    candidates AS MATERIALIZED (
        SELECT p.chunk_key, sum(t.bound * p.impact) AS seen,
               sum(t.bound * p.impact - coalesce(t.rest, 0)) + (SELECT bound FROM unread) AS upper
        FROM t, LATERAL (
            SELECT chunk_key, impact FROM keyword_postings WHERE term = t.term ORDER BY impact DESC LIMIT t.depth
        ) AS p
        GROUP BY p.chunk_key)
    SELECT (SELECT bound FROM unread) AS unread,
           ARRAY(SELECT rest FROM t ORDER BY ordinal) AS rests,
           ARRAY(SELECT chunk_key FROM candidates ORDER BY seen DESC, chunk_key LIMIT $6) AS likely,
           (SELECT count(*) FROM candidates WHERE upper >= $4) AS contenders,
           ARRAY(SELECT chunk_key FROM candidates WHERE upper >= $4 ORDER BY upper DESC, chunk_key LIMIT $5) AS keys,
           ARRAY(SELECT upper FROM candidates WHERE upper >= $4 ORDER BY upper DESC, chunk_key LIMIT $5) AS bounds
"""

# The impact at each given depth of a term's list (NULL past its end): by short index scans that
# return one row each, a fraction of a round's cost, to plan the next round's depths.
_IMPACTS_AT = f"""
    SELECT {_IMPACT_AT_DEPTH}
    FROM unnest($1::bigint[], $2::int[]) WITH ORDINALITY AS t(term, depth, ordinal)
    ORDER BY t.ordinal
"""

# The exact BM25 of the given chunks that are in scope, with the in-scope df of each query term.
# $1: chunk keys, $2: limit, the scope's parameters from $3.
_SCORE_CHUNKS = """
    WITH q AS (SELECT ${lexemes}::text[] AS lexemes, ${bigrams}::text[] AS bigrams),
    frequencies AS (SELECT * FROM unnest(${fields}::smallint[], ${terms}::text[], ${dfs}::float8[])
                    AS f(field, lexeme, df)),
    hits AS (
        SELECT c.id, h.field, CASE h.field WHEN 0 THEN c.lexeme_count ELSE c.bigram_count END AS dl,
               h.lexeme, greatest(h.tf, 1) AS tf
        FROM q, chunks c {joins}, LATERAL (
            SELECT 0::smallint AS field, m.lexeme, cardinality(m.positions) AS tf
            FROM unnest(ts_filter(setweight(c.search_vector, 'B', q.lexemes), '{{b}}')) AS m
            WHERE m.lexeme = ANY(q.lexemes)
            UNION ALL
            SELECT 1::smallint, m.lexeme, cardinality(m.positions)
            FROM unnest(ts_filter(setweight(c.bigram_vector, 'B', q.bigrams), '{{b}}')) AS m
            WHERE m.lexeme = ANY(q.bigrams)
        ) AS h
        WHERE c.posting_key = ANY($1::bigint[]) AND {scope}),
    p AS (SELECT ${k1}::float8 AS k1, ${b}::float8 AS b, ${n}::float8 AS n, ${avg_words}::float8 AS avg_words,
                 ${avg_bigrams}::float8 AS avg_bigrams, ${bigram_weight}::float8 AS bigram_weight)
    SELECT id, {score} AS score FROM hits JOIN frequencies USING (field, lexeme), p
    GROUP BY id ORDER BY score DESC, id LIMIT $2
"""


@dataclass(frozen=True, slots=True)
class Bm25Statistics:
    """What a BM25 score needs besides the chunk: parameters and corpus-wide statistics."""

    k1: float
    b: float
    bigram_weight: float
    chunks: float
    average_words: float
    average_bigrams: float


class _Frequency(NamedTuple):
    """A query term's row of ``_FREQUENCIES``."""

    field: int
    lexeme: str
    term: int
    df: float
    restricted: int
    everywhere: float
    versions: str


SELECTIVE_SCOPE = "exact: selective scope"
"""The path of a scope holding under ``min_share`` of the terms' postings: its exact scan reads the
scope's chunks first (``SearchStore``) when they are fewer than the corpus's matches."""

WHOLE_LISTS = "postings: whole lists"
"""The path of a search whose rounds went deep, answered from its terms' whole lists in memory
(``storage/term_lists.py``)."""

DOCUMENT_FILTERS = "exact: document filters"
"""The path of a scope with document filters (knowledge bases, sources, metadata), whose in-scope df
is not kept: its exact scan reads the scope's chunks first, as a selective scope's, when they are
fewer than the corpus's matches."""


class PostingsAnswer(NamedTuple):
    """What ``ImpactOrderedPostings.top`` found: the path taken, the exact top-k (``None``: the caller
    must score exactly), and for a selective scope or document filters the terms' postings in the
    whole corpus, a bound of the chunks the exact scan would read matches first (0 otherwise)."""

    path: str
    hits: list[tuple[str, float]] | None
    corpus_postings: int = 0


@dataclass(frozen=True, slots=True)
class _Term:
    field: int
    lexeme: str
    key: int
    df: float
    bound: float  # weight × idf × drift × rounding slack: multiplies the last impact read
    scale: float  # weight × idf × rounding slack: multiplies a term-frequency part under current lengths
    version: tuple[int, ...]  # of its postings (storage/term_lists.py)
    postings: float  # in the whole corpus


class ImpactOrderedPostings:
    """The read side of migration 0017's postings (see the module docstring).

    ``exact_below``: with fewer in-scope postings of the query's terms, scoring them all is as cheap
    (measured on the PostgreSQL 15 docs, 6,946 chunks, 200 page titles; docs/benchmarks.md, "Hybrid
    search latency beside LlamaIndex": the exact scan costs in proportion to the matches, not the
    scope, and only wins below a few hundred postings).
    ``min_share``: a scope holding a smaller share of the terms' postings would make the lists read
    mostly chunks it excludes, so the exact path scores its own chunks instead. ``first_depth``: the
    postings read per term in the first round (4× per deeper round, up to ``max_depth``).
    ``max_read_share``: once the lists would read more than this share of the in-scope postings, the
    exact path takes over; by default never, as reading every posting costs less than scoring every
    match (at a million chunks, 0.7–1.2 µs a posting against 9–35 µs a chunk, 10 s for the deepest
    title queries). ``max_scored`` and ``scoring_cost``: a round hands to exact scoring at most
    ``max_scored`` chunks, or more while they cost less than a next round would read (one chunk
    scored costs about as much as ``scoring_cost`` postings read: 2026-12-06, 1M chunks, 9–35 µs
    against 0.7–1.2); with more chunks whose bound reaches the threshold, reading deeper tightens
    their bounds first. ``plan_from``: once a list is read this deep (a round then costs several
    milliseconds), the next round's depths are planned from the impacts at deeper points of the
    lists rather than stepped 4× (``_planned_depths``). ``whole_lists`` and ``lists_from``: once a
    list is read this deep, a search whose terms' whole lists fit in the budget
    (``storage/term_lists.py``) sums them in memory instead, every chunk's bound at once, and scores
    the chunks in bound order until the bound falls below the ``limit``-th score: the same exact top-k
    without more rounds; a search whose long lists are all kept does so before any round."""

    # Impacts are stored as float4 (relative error 2^-24); the bound must never fall below a score.
    _SLACK = 1 + 1e-6

    def __init__(
        self,
        *,
        exact_below: int = 500,
        min_share: float = 0.2,
        first_depth: int = 64,
        max_depth: int = 1 << 20,
        max_read_share: float = 1.0,
        max_scored: int = 1024,
        scoring_cost: float = 16.0,
        plan_from: int = 4096,
        whole_lists: TermLists | None = None,
        lists_from: int = 1024,
    ) -> None:
        self.exact_below = exact_below
        self.min_share = min_share
        self.first_depth = first_depth
        self.max_depth = max_depth
        self.max_read_share = max_read_share
        self.max_scored = max_scored
        self.scoring_cost = scoring_cost
        self.plan_from = plan_from
        self.whole_lists = whole_lists
        self.lists_from = lists_from

    async def top(
        self,
        db: Any,
        words: Sequence[str],
        query: str | None,
        limit: int,
        scope: Scope,
        statistics: Bm25Statistics,
    ) -> PostingsAnswer:
        """The path taken and the exact BM25 top ``limit`` of the query's ``words`` and, with
        ``query``, its CJK bigrams (``BM25_TERMS``), when the postings give it."""
        if scope.document_filters:
            # Their in-scope df is not kept: the exact scan, the scope's own chunks first while they
            # are fewer than the terms' postings in the corpus (a narrow knowledge base or source).
            postings = await db.fetchval(_CORPUS_POSTINGS, list(words), query)
            return PostingsAnswer(DOCUMENT_FILTERS, None if postings else [], int(postings))
        reference = await db.fetchrow(_FREQUENCIES.format(scope=scope.sql), list(words), query, *scope.params)
        assert reference is not None
        if reference["k1"] is None or (reference["k1"], reference["b"]) != (statistics.k1, statistics.b):
            return PostingsAnswer("exact: other k1, b", None)
        rows = [_Frequency(*row) for row in reference["terms"]]
        if any(row.restricted for row in rows):
            return PostingsAnswer("exact: ACL", None)
        present = [row for row in rows if row.df > 0]
        if not present:
            return PostingsAnswer("postings", [])
        in_scope = sum(row.df for row in present)
        everywhere = sum(row.everywhere for row in present)
        if in_scope < self.min_share * everywhere:
            return PostingsAnswer(SELECTIVE_SCOPE, None, int(everywhere))
        if in_scope < self.exact_below:
            return PostingsAnswer("exact: small scope", None)
        drift = {
            0: _drift(statistics.average_words, reference["average_words"]),
            1: _drift(statistics.average_bigrams, reference["average_bigrams"]),
        }
        if any(drift[row.field] == math.inf for row in present):
            return PostingsAnswer("exact: no reference lengths", None)
        version = reference["reference_version"]  # with each term's rows', the version of its postings
        # weight × idf × rounding slack per term; times the drift, the bound of a stored impact
        scales = [
            (1.0 if row.field == 0 else statistics.bigram_weight) * _idf(statistics.chunks, row.df) * self._SLACK
            for row in present
        ]
        terms = [
            _Term(
                row.field,
                row.lexeme,
                row.term,
                row.df,
                scale * drift[row.field],
                scale,
                _version(row.versions, version),
                row.everywhere,
            )
            for row, scale in zip(present, scales, strict=True)
        ]
        scorer = _Scorer(db, terms, reference["lexemes"], reference["bigrams"], limit, scope, statistics)
        rescaling = _rescaling(statistics, reference)
        if self._lists_kept(db, terms, rescaling):
            return PostingsAnswer(WHOLE_LISTS, await self._from_whole_lists(db, terms, rescaling, scorer))
        depths = [self.first_depth] * len(terms)
        more = 0  # contenders to return beyond the round's share, once nothing is left to read
        while True:
            # As many as scoring costs less than the next round would read (at least 2× this one).
            returned = max(self.max_scored, int(2 * _postings_read(depths, terms) / self.scoring_cost), more)
            known = scorer.threshold
            row = await db.fetchrow(
                _READ,
                [t.key for t in terms],
                depths,
                [t.bound for t in terms],
                known if known is not None else -math.inf,
                returned,
                2 * limit,
            )
            assert row is not None
            await scorer.score(row["likely"])
            threshold = scorer.threshold
            unread = row["unread"]
            read_enough = unread == 0 or (threshold is not None and threshold > unread)
            # Every chunk whose bound reaches the threshold is among the keys (the threshold only grew).
            if read_enough and row["contenders"] <= returned:
                return PostingsAnswer("postings", await scorer.best(row["keys"], row["bounds"]))
            if max(depths) >= self.lists_from and self._lists_fit(db, terms, rescaling):
                return PostingsAnswer(WHOLE_LISTS, await self._from_whole_lists(db, terms, rescaling, scorer))
            rests = sorted(((rest, index) for index, rest in enumerate(row["rests"]) if rest is not None), reverse=True)
            if read_enough and not rests:  # every list read to its end: score every contender
                more = row["contenders"]
                continue
            if not read_enough and threshold is not None and max(depths) >= self.plan_from:
                planned = await self._planned_depths(db, terms, depths, rests, threshold)
                if planned is not None:
                    depths = planned
                    if _postings_read(depths, terms) > self.max_read_share * in_scope:
                        return PostingsAnswer("exact: too deep", None)
                    continue
            # Not read enough: deepen the lists that keep the bound of unread chunks at or above the
            # threshold, the largest first (all of them while fewer than ``limit`` chunks were found).
            # Too many contenders: deepen the lists that hold half the slack of their bounds.
            # A round costs about the postings of its deepest list: a list deepened goes at least to a
            # quarter of that depth, in one round rather than in several ×4 steps that each read it.
            remaining, target = sum(rest for rest, _ in rests), threshold
            if read_enough:
                target = remaining / 2
            deepest = max(depths)
            for rest, index in rests:
                if target is not None and remaining < target:
                    break
                if depths[index] >= self.max_depth:
                    return PostingsAnswer("exact: too deep", None)
                depths[index] = max(4 * depths[index], deepest // 4)
                remaining -= rest
            # Flat impacts (many chunks alike, copies) need deep lists: past a share of the matches,
            # the scan that scores them all once is cheaper than more rounds.
            if _postings_read(depths, terms) > self.max_read_share * in_scope:
                return PostingsAnswer("exact: too deep", None)

    async def warm(self, db: Any, statistics: Bm25Statistics, share: float = 0.5) -> int:
        """Load the whole lists of the corpus's most frequent terms (over ``lists_from`` postings)
        into ``share`` of the budget: those the first deep searches would load. Returns how many.
        ``db``: a snapshot's connection, ``statistics``: those the searches use, or the lists would
        not match theirs."""
        lists = self.whole_lists
        if lists is None or not isinstance(db, asyncpg.Connection):
            return 0
        reference = await db.fetchrow(_REFERENCE)
        if reference is None or (reference["k1"], reference["b"]) != (statistics.k1, statistics.b):
            return 0  # no reference yet (an empty corpus), or other BM25 parameters: the exact path serves
        rescaling = _rescaling(statistics, reference)
        room = share * lists.budget_bytes
        loaded = 0
        for row in await db.fetch(_FREQUENT_TERMS, 1024, self.lists_from):
            size = TermLists.BYTES_PER_POSTING * row["postings"]
            if size <= room:
                version = _version(row["versions"], reference["reference_version"])
                await lists.get(db, row["term"], row["field"], version, rescaling)
                room -= size
                loaded += 1
        return loaded

    def _lists_kept(self, db: Any, terms: Sequence[_Term], rescaling: Rescaling) -> bool:
        """Whether the terms' whole lists answer before any round: they may be used (``_lists_fit``),
        and every long list (over ``lists_from`` postings) is kept at the version this snapshot
        reads, at least one of them; the short ones load in about a millisecond each."""
        lists = self.whole_lists
        long = [term for term in terms if term.postings > self.lists_from]
        return (
            lists is not None
            and bool(long)
            and all(lists.holds(term.key, term.version, rescaling) for term in long)
            and self._lists_fit(db, terms, rescaling)
        )

    def _lists_fit(self, db: Any, terms: Sequence[_Term], rescaling: Rescaling) -> bool:
        """Whether the terms' whole lists may be loaded: on a snapshot's connection (a list and its
        version must be read in one snapshot), within the budget, and none of them loaded again too
        soon (``TermLists.reload_after_s``)."""
        lists = self.whole_lists
        return (
            lists is not None
            and isinstance(db, asyncpg.Connection)
            and TermLists.BYTES_PER_POSTING * sum(term.postings for term in terms) <= lists.budget_bytes
            and all(lists.may_load(term.key, term.version, rescaling) for term in terms)
        )

    async def _from_whole_lists(
        self, db: Any, terms: Sequence[_Term], rescaling: Rescaling, scorer: _Scorer
    ) -> list[tuple[str, float]]:
        """The exact top-k from the terms' whole lists: every chunk's bound (its term-frequency parts
        under the current lengths times the terms' idf: its score, to the rounding slack) summed at
        once, the chunks scored in bound order until the bound falls below the ``limit``-th score."""
        assert self.whole_lists is not None
        lists = [await self.whole_lists.get(db, term.key, term.field, term.version, rescaling) for term in terms]
        held = [postings for postings in lists if len(postings.keys)]
        if not held:
            return []
        low = min(postings.low for postings in held)
        bounds = np.zeros(max(postings.high for postings in held) - low + 1)
        for postings, term in zip(lists, terms, strict=True):
            # add.at, not +=: a chunk twice in a list (two lexemes of one hash) counts twice.
            np.add.at(bounds, postings.keys - low, np.multiply(postings.parts, term.scale, dtype=np.float64))
        threshold = scorer.threshold
        if threshold is not None:  # a chunk whose bound is below it can never enter
            chosen = np.flatnonzero(bounds >= threshold)
            chosen = chosen[np.argsort(-bounds[chosen], kind="stable")]
            return await scorer.best((chosen + low).tolist(), bounds[chosen].tolist())
        candidates = int(np.count_nonzero(bounds))
        wanted = 4 * scorer.limit
        while True:
            chosen = _highest_first(bounds, wanted)
            hits = await scorer.best((chosen + low).tolist(), bounds[chosen].tolist())
            threshold = scorer.threshold
            if len(chosen) == candidates or (threshold is not None and bounds[chosen[-1]] < threshold):
                return hits
            wanted = 8 * len(chosen)

    async def _planned_depths(
        self, db: Any, terms: Sequence[_Term], depths: list[int], rests: list[tuple[float, int]], threshold: float
    ) -> list[int] | None:
        """Depths at which the bound of an unread chunk falls below ``threshold``: from the impacts at
        4×, 16× and 64× each open list's depth, deepen greedily the list that lowers the bound most
        per posting added. A round costs about its postings, and each round reads its lists from the
        top again: one planned round instead of several ×4 steps. ``None`` when those depths would
        not do."""
        steps = [
            (index, depths[index] * 4**power)
            for _, index in rests
            for power in (1, 2, 3)
            if depths[index] * 4**power <= self.max_depth
        ]
        if not steps:
            return None
        rows = await db.fetch(_IMPACTS_AT, [terms[index].key for index, _ in steps], [depth for _, depth in steps])
        rest_at: dict[int, list[tuple[int, float]]] = {}
        for (index, depth), row in zip(steps, rows, strict=True):
            rest_at.setdefault(index, []).append((depth, 0.0 if row[0] is None else terms[index].bound * row[0]))
        current = {index: (depths[index], rest) for rest, index in rests}
        remaining = sum(rest for rest, _ in rests)
        planned = list(depths)
        while remaining >= threshold:
            moves = [
                ((rest - deeper_rest) / (depth - current[index][0]), index, depth, rest - deeper_rest)
                for index, options in rest_at.items()
                for depth, deeper_rest in options
                if depth > current[index][0] and (rest := current[index][1]) > deeper_rest
            ]
            if not moves:
                return None
            _, index, depth, lowered = max(moves)
            remaining -= lowered
            current[index] = (depth, current[index][1] - lowered)
            planned[index] = depth
        return planned


class _Scorer:
    """Exact BM25 of candidate chunks for one search, each chunk scored once across rounds."""

    def __init__(
        self,
        db: Any,
        terms: Sequence[_Term],
        lexemes: Sequence[str],
        bigrams: Sequence[str],
        limit: int,
        scope: Scope,
        statistics: Bm25Statistics,
    ) -> None:
        self._db = db
        self.limit = limit
        self._scope = scope
        self._scored: set[int] = set()
        self._hits: list[tuple[str, float]] = []
        self._values: dict[str, Any] = {
            "lexemes": list(lexemes),
            "bigrams": list(bigrams),
            "fields": [term.field for term in terms],
            "terms": [term.lexeme for term in terms],
            "dfs": [term.df for term in terms],
            "k1": statistics.k1,
            "b": statistics.b,
            "n": statistics.chunks,
            "avg_words": statistics.average_words,
            "avg_bigrams": statistics.average_bigrams,
            "bigram_weight": statistics.bigram_weight,
        }
        first = 3 + len(scope.params)
        numbers = {name: first + offset for offset, name in enumerate(self._values)}
        self._sql = _SCORE_CHUNKS.format(joins=scope.joins_by_chunk, scope=scope.sql, score=BM25_SCORE, **numbers)

    @property
    def threshold(self) -> float | None:
        """The ``limit``-th best exact score so far (``None`` while fewer chunks were found)."""
        return self._hits[-1][1] if len(self._hits) == self.limit else None

    async def score(self, keys: Sequence[int]) -> None:
        """Score those of ``keys`` not scored yet (the ones out of scope score nothing)."""
        todo = [key for key in keys if key not in self._scored]
        if not todo:
            return
        self._scored.update(todo)
        rows = await self._db.fetch(self._sql, todo, self.limit, *self._scope.params, *self._values.values())
        merged = self._hits + [(row["id"], row["score"]) for row in rows]
        self._hits = sorted(merged, key=lambda hit: (-hit[1], hit[0]))[: self.limit]

    async def best(self, keys: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, float]]:
        """The top ``limit`` among the chunks scored so far, after scoring every one of ``keys``
        (ordered by their upper ``bounds``, highest first) that could still reach it."""
        batch = max(2 * self.limit, 64)
        start = 0
        while start < len(keys):
            threshold = self.threshold
            if threshold is not None and bounds[start] < threshold:
                break
            await self.score(keys[start : start + batch])
            start += batch
            batch *= 4
        return self._hits


def _highest_first(bounds: npt.NDArray[np.float64], wanted: int) -> npt.NDArray[np.intp]:
    """The indexes of at least ``wanted`` of the highest positive ``bounds`` (all of them if fewer),
    highest first. The cut is read off a histogram: ``argpartition`` takes tens of milliseconds on a
    million bounds of which a hundred thousand are equal (the same footer in every page)."""
    chosen = np.flatnonzero(bounds)
    if len(chosen) > wanted:
        values = bounds[chosen]
        counts, edges = np.histogram(values, bins=1024)
        from_top = np.cumsum(counts[::-1])
        chosen = chosen[values >= edges[len(counts) - 1 - int(np.searchsorted(from_top, wanted))]]
    return chosen[np.argsort(-bounds[chosen], kind="stable")]


def _version(row_versions: str, reference_version: int) -> tuple[int, ...]:
    """A term's list version from its rows' comma-separated transaction ids and the reference row's."""
    return list_version([int(version) for version in row_versions.split(",") if version], reference_version)


def _rescaling(statistics: Bm25Statistics, reference: Any) -> Rescaling:
    """From the impacts stored under ``reference``'s average lengths to those of ``statistics``."""
    return Rescaling(
        statistics.k1,
        statistics.b,
        (reference["average_words"] or 0.0, reference["average_bigrams"] or 0.0),
        (statistics.average_words, statistics.average_bigrams),
    )


def _postings_read(depths: Sequence[int], terms: Sequence[_Term]) -> float:
    """How many in-scope postings lists read as deep as ``depths`` hold at most."""
    return sum(min(depth, term.df) for depth, term in zip(depths, terms, strict=True))


def _idf(chunks: float, df: float) -> float:
    """Lucene's idf, as the SQL computes it."""
    return math.log(1 + (max(chunks, df) - df + 0.5) / (df + 0.5))


def _drift(current: float, reference: float | None) -> float:
    """How much larger a term-frequency part can be now than under the reference average length."""
    if reference is None or reference <= 0:
        return math.inf
    return max(1.0, current / reference)


async def refresh_impacts(pool: asyncpg.Pool, *, tolerance: float = 1.25) -> bool:
    """Rewrite every stored impact under the current average lengths when they have grown past
    ``tolerance`` × the reference ones (the bound loosens by that ratio, so searches read deeper);
    returns whether it did. Rankings are exact either way. Commits wait for the rewrite."""
    row = await pool.fetchrow(
        "SELECT r.average_words AS ref_words, r.average_bigrams AS ref_bigrams,"
        " (SELECT avg(lexeme_count) FROM chunks)::float8 AS words,"
        " (SELECT avg(bigram_count) FILTER (WHERE bigram_count > 0) FROM chunks)::float8 AS bigrams"
        " FROM keyword_reference r"
    )
    if row is None:
        return False
    drifted = any(
        current is not None and _drift(current, reference) > tolerance
        for current, reference in ((row["words"], row["ref_words"]), (row["bigrams"], row["ref_bigrams"]))
    )
    if drifted:
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute("SELECT keyword_refresh_impacts()")
    return drifted
