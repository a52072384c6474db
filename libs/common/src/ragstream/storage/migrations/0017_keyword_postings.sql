-- Keyword leg: impact-ordered postings, so BM25 top-k reads the best postings of each query term
-- instead of scoring every chunk that holds one (storage/postings.py, docs/keyword-leg.md).
--
-- keyword_postings: one row per (field, lexeme, chunk): field 0 = words (search_vector), 1 = CJK
-- bigrams (bigram_vector). ``impact`` is the BM25 term-frequency part
-- tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)) under the reference statistics of
-- keyword_reference; idf is not stored: it depends on the caller's scope and is computed per query.
-- keyword_df: document frequency per connection, index version, field and lexeme, and how many of
-- those chunks carry an ACL, so a query reads the exact in-scope df of its terms in a few rows.
-- Triggers on chunks keep both in the transaction that writes or deletes the chunks (a commit, a
-- deletion, a re-chunk switch, an ACL change, a connection's removal), like the bigrams of 0004.

-- A compact key for a chunk in the postings (the chunk ids are 32-character text).
ALTER TABLE chunks ADD COLUMN posting_key bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE chunks ADD CONSTRAINT chunks_posting_key_key UNIQUE (posting_key);

-- The statistics the stored impacts were computed with; one row. The query-time bound scales an
-- impact by max(1, current avgdl / reference avgdl), which provably covers the drift (postings.py).
CREATE TABLE keyword_reference (
    single           boolean PRIMARY KEY DEFAULT true CHECK (single),
    k1               float8 NOT NULL,
    b                float8 NOT NULL,
    average_words    float8,
    average_bigrams  float8
);
INSERT INTO keyword_reference (k1, b, average_words, average_bigrams)
    SELECT 1.2, 0.75, avg(lexeme_count)::float8, (avg(bigram_count) FILTER (WHERE bigram_count > 0))::float8 FROM chunks;

CREATE TABLE keyword_postings (
    term       bigint NOT NULL,  -- keyword_term(field, lexeme)
    impact     real NOT NULL,
    field      smallint NOT NULL,
    tf         smallint NOT NULL,
    chunk_key  bigint NOT NULL   -- chunks.posting_key; removed by the chunks triggers below
);

CREATE TABLE keyword_df (
    field          smallint NOT NULL,
    lexeme         text NOT NULL,
    connection_id  text NOT NULL REFERENCES connections (id) ON DELETE CASCADE,
    index_version  integer NOT NULL,
    chunks         integer NOT NULL,
    restricted     integer NOT NULL,  -- of those, chunks with an ACL (acl IS NOT NULL)
    PRIMARY KEY (field, lexeme, connection_id, index_version)
);

-- A 64-bit hash of the field and lexeme: a collision only adds candidates, which are re-scored exactly.
CREATE FUNCTION keyword_term(field smallint, lexeme text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT hashtextextended(lexeme, field) $$;

CREATE FUNCTION keyword_impact(tf integer, dl integer, average float8, k1 float8, b float8) RETURNS real
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT (tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / average)))::real $$;

-- The (field, lexeme, tf) of a chunk, tf counted as the keyword leg counts it.
CREATE FUNCTION keyword_chunk_terms(search_vector tsvector, bigram_vector tsvector)
    RETURNS TABLE (field smallint, lexeme text, tf integer)
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT 0::smallint, m.lexeme, greatest(cardinality(m.positions), 1) FROM unnest(search_vector) AS m
    UNION ALL
    SELECT 1::smallint, m.lexeme, greatest(cardinality(m.positions), 1) FROM unnest(bigram_vector) AS m
$$;

-- What the triggers need of a chunk.
CREATE TYPE keyword_chunk AS (
    posting_key    bigint,
    document_id    text,
    index_version  integer,
    restricted     boolean,
    lexeme_count   integer,
    bigram_count   integer,
    search_vector  tsvector,
    bigram_vector  tsvector
);

-- Adds (sign 1) or removes (sign -1) the chunks' postings and document frequencies. Writers of one
-- connection's frequencies serialise on an advisory lock taken in connection order, so two
-- transactions that each remove and add rows cannot deadlock on them.
CREATE FUNCTION keyword_apply(changed keyword_chunk[], sign integer) RETURNS void
    LANGUAGE plpgsql
AS $$
DECLARE
    reference keyword_reference;
    emptied keyword_df[];
BEGIN
    IF cardinality(changed) = 0 THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('keyword_df'), hashtext(connection_id))
    FROM (SELECT DISTINCT d.connection_id FROM unnest(changed) AS n JOIN documents d ON d.id = n.document_id
          ORDER BY d.connection_id) AS touched;
    IF sign > 0 THEN
        -- The first chunks of an empty corpus (or its first Chinese ones) set the reference lengths;
        -- afterwards the row is only read, so commits do not queue on it.
        SELECT * INTO reference FROM keyword_reference FOR KEY SHARE;
        IF reference.average_words IS NULL OR (reference.average_bigrams IS NULL
                AND EXISTS (SELECT 1 FROM unnest(changed) AS n WHERE n.bigram_count > 0)) THEN
            UPDATE keyword_reference SET
                average_words = coalesce(average_words, (SELECT avg(n.lexeme_count) FROM unnest(changed) AS n)),
                average_bigrams = coalesce(average_bigrams,
                    (SELECT avg(n.bigram_count) FILTER (WHERE n.bigram_count > 0) FROM unnest(changed) AS n))
            RETURNING * INTO reference;
        END IF;
        INSERT INTO keyword_postings (term, impact, field, tf, chunk_key)
        SELECT keyword_term(t.field, t.lexeme),
               keyword_impact(t.tf, CASE t.field WHEN 0 THEN n.lexeme_count ELSE n.bigram_count END,
                              CASE t.field WHEN 0 THEN reference.average_words ELSE reference.average_bigrams END,
                              reference.k1, reference.b),
               t.field, least(t.tf, 32767), n.posting_key
        FROM unnest(changed) AS n, keyword_chunk_terms(n.search_vector, n.bigram_vector) AS t;
        INSERT INTO keyword_df AS f (field, lexeme, connection_id, index_version, chunks, restricted)
        SELECT t.field, t.lexeme, d.connection_id, n.index_version, count(*), count(*) FILTER (WHERE n.restricted)
        FROM unnest(changed) AS n JOIN documents d ON d.id = n.document_id,
             keyword_chunk_terms(n.search_vector, n.bigram_vector) AS t
        GROUP BY 1, 2, 3, 4
        ORDER BY 1, 2, 3, 4
        ON CONFLICT (field, lexeme, connection_id, index_version) DO UPDATE
            SET chunks = f.chunks + EXCLUDED.chunks, restricted = f.restricted + EXCLUDED.restricted;
    ELSE
        DELETE FROM keyword_postings WHERE chunk_key IN (SELECT n.posting_key FROM unnest(changed) AS n);
        -- Chunks deleted with their documents (a connection's removal) have no document row left: their
        -- frequencies went with the connection (ON DELETE CASCADE).
        WITH removed AS (
            SELECT t.field, t.lexeme, d.connection_id, n.index_version, count(*) AS chunks,
                   count(*) FILTER (WHERE n.restricted) AS restricted
            FROM unnest(changed) AS n JOIN documents d ON d.id = n.document_id,
                 keyword_chunk_terms(n.search_vector, n.bigram_vector) AS t
            GROUP BY 1, 2, 3, 4),
        decremented AS (
            UPDATE keyword_df f SET chunks = f.chunks - r.chunks, restricted = f.restricted - r.restricted
            FROM removed r
            WHERE f.field = r.field AND f.lexeme = r.lexeme AND f.connection_id = r.connection_id
              AND f.index_version = r.index_version
            RETURNING f.*)
        SELECT array_agg(e) INTO emptied FROM decremented AS e WHERE e.chunks <= 0;
        -- Only the rows this removal emptied, by primary key: a scan for every empty row would read
        -- the whole table on each edit or deletion.
        DELETE FROM keyword_df f USING unnest(emptied) AS e
        WHERE f.field = e.field AND f.lexeme = e.lexeme AND f.connection_id = e.connection_id
          AND f.index_version = e.index_version AND f.chunks <= 0;
    END IF;
END
$$;

CREATE FUNCTION keyword_chunks_inserted() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM keyword_apply(ARRAY(SELECT ROW(n.posting_key, n.document_id, n.index_version, n.acl IS NOT NULL,
        n.lexeme_count, n.bigram_count, n.search_vector, n.bigram_vector)::keyword_chunk FROM new_chunks n), 1);
    RETURN NULL;
END
$$;

CREATE FUNCTION keyword_chunks_deleted() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM keyword_apply(ARRAY(SELECT ROW(o.posting_key, o.document_id, o.index_version, o.acl IS NOT NULL,
        o.lexeme_count, o.bigram_count, o.search_vector, o.bigram_vector)::keyword_chunk FROM old_chunks o), -1);
    RETURN NULL;
END
$$;

-- An update that changes what the postings or frequencies hold (an ACL set or cleared, new text)
-- removes the old row's contribution and adds the new one's.
CREATE FUNCTION keyword_chunks_updated() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM keyword_apply(ARRAY(SELECT ROW(o.posting_key, o.document_id, o.index_version, o.acl IS NOT NULL,
        o.lexeme_count, o.bigram_count, o.search_vector, o.bigram_vector)::keyword_chunk
        FROM old_chunks o JOIN new_chunks n ON n.posting_key = o.posting_key
        WHERE (o.acl IS NULL) <> (n.acl IS NULL) OR o.search_vector <> n.search_vector
           OR o.bigram_vector <> n.bigram_vector OR o.lexeme_count <> n.lexeme_count
           OR o.bigram_count <> n.bigram_count OR o.index_version <> n.index_version), -1);
    PERFORM keyword_apply(ARRAY(SELECT ROW(n.posting_key, n.document_id, n.index_version, n.acl IS NOT NULL,
        n.lexeme_count, n.bigram_count, n.search_vector, n.bigram_vector)::keyword_chunk
        FROM old_chunks o JOIN new_chunks n ON n.posting_key = o.posting_key
        WHERE (o.acl IS NULL) <> (n.acl IS NULL) OR o.search_vector <> n.search_vector
           OR o.bigram_vector <> n.bigram_vector OR o.lexeme_count <> n.lexeme_count
           OR o.bigram_count <> n.bigram_count OR o.index_version <> n.index_version), 1);
    RETURN NULL;
END
$$;

-- Rewrites every impact under the current average lengths: run when they drifted far from the
-- reference (postings.refresh_impacts): drift only loosens the bound, it never changes a ranking.
CREATE FUNCTION keyword_refresh_impacts() RETURNS void
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM 1 FROM keyword_reference FOR UPDATE;
    UPDATE keyword_reference SET
        average_words = (SELECT avg(lexeme_count) FROM chunks),
        average_bigrams = (SELECT avg(bigram_count) FILTER (WHERE bigram_count > 0) FROM chunks);
    UPDATE keyword_postings p SET impact = keyword_impact(p.tf::integer,
            CASE p.field WHEN 0 THEN c.lexeme_count ELSE c.bigram_count END,
            CASE p.field WHEN 0 THEN r.average_words ELSE r.average_bigrams END, r.k1, r.b)
    FROM chunks c, keyword_reference r
    WHERE c.posting_key = p.chunk_key;
END
$$;

-- Backfill: every chunk indexed before this migration (the triggers do not exist yet), set-based.
INSERT INTO keyword_postings (term, impact, field, tf, chunk_key)
SELECT keyword_term(t.field, t.lexeme),
       keyword_impact(t.tf, CASE t.field WHEN 0 THEN c.lexeme_count ELSE c.bigram_count END,
                      CASE t.field WHEN 0 THEN r.average_words ELSE r.average_bigrams END, r.k1, r.b),
       t.field, least(t.tf, 32767), c.posting_key
FROM keyword_reference r, chunks c, keyword_chunk_terms(c.search_vector, c.bigram_vector) AS t;
INSERT INTO keyword_df (field, lexeme, connection_id, index_version, chunks, restricted)
SELECT t.field, t.lexeme, d.connection_id, c.index_version, count(*), count(*) FILTER (WHERE c.acl IS NOT NULL)
FROM chunks c JOIN documents d ON d.id = c.document_id, keyword_chunk_terms(c.search_vector, c.bigram_vector) AS t
GROUP BY 1, 2, 3, 4;

CREATE INDEX keyword_postings_term_impact_idx ON keyword_postings (term, impact DESC) INCLUDE (chunk_key);
CREATE INDEX keyword_postings_chunk_idx ON keyword_postings (chunk_key);

CREATE TRIGGER keyword_chunks_inserted AFTER INSERT ON chunks
    REFERENCING NEW TABLE AS new_chunks FOR EACH STATEMENT EXECUTE FUNCTION keyword_chunks_inserted();
CREATE TRIGGER keyword_chunks_deleted AFTER DELETE ON chunks
    REFERENCING OLD TABLE AS old_chunks FOR EACH STATEMENT EXECUTE FUNCTION keyword_chunks_deleted();
CREATE TRIGGER keyword_chunks_updated AFTER UPDATE ON chunks
    REFERENCING OLD TABLE AS old_chunks NEW TABLE AS new_chunks FOR EACH STATEMENT
    EXECUTE FUNCTION keyword_chunks_updated();
