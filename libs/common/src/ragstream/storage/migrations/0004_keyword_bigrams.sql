-- Keyword leg: Chinese character bigrams beside the word index, and what BM25 needs to rank both.
--
-- search_vector holds jieba words: a query word that jieba cut differently in the document (or
-- across a word boundary) misses. bigram_vector holds every pair of adjacent CJK characters of the
-- title, heading path and text, so the keyword leg also matches Chinese by overlapping bigrams; on
-- InsuranceQA (zh) words + bigrams rank better than either alone (docs/retrieval-quality.md).
-- A trigger derives it from the row, so every writer of chunks keeps it right without knowing.

-- Adjacent CJK character pairs of the text, space-separated; a lone CJK character stays itself.
CREATE FUNCTION cjk_bigrams(body text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT coalesce(string_agg(substr(m.run[1], i, 2), ' ' ORDER BY m.n, i), '')
    FROM regexp_matches(body, '[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+', 'g') WITH ORDINALITY AS m(run, n),
         generate_series(1, greatest(length(m.run[1]) - 1, 1)) AS i
$$;

ALTER TABLE chunks ADD COLUMN bigram_vector tsvector NOT NULL DEFAULT ''::tsvector;
-- Number of bigrams with repetitions: the BM25 length of the bigram field.
ALTER TABLE chunks ADD COLUMN bigram_count integer NOT NULL DEFAULT 0;

CREATE FUNCTION chunks_set_bigrams() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    NEW.bigram_vector := to_tsvector('simple', cjk_bigrams(concat_ws(' ',
        (SELECT d.title FROM documents d WHERE d.id = NEW.document_id), NEW.heading, NEW.text)));
    NEW.bigram_count := (SELECT coalesce(sum(cardinality(b.positions)), 0) FROM unnest(NEW.bigram_vector) AS b);
    RETURN NEW;
END
$$;
CREATE TRIGGER chunks_set_bigrams BEFORE INSERT OR UPDATE OF heading, text ON chunks
    FOR EACH ROW EXECUTE FUNCTION chunks_set_bigrams();

-- Chunks indexed before this migration: only those with CJK characters have bigrams to add.
UPDATE chunks c SET text = c.text FROM documents d
    WHERE d.id = c.document_id AND concat_ws(' ', d.title, c.heading, c.text) ~ '[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]';

CREATE INDEX chunks_bigram_vector_idx ON chunks USING gin (bigram_vector);
-- The corpus statistics the keyword leg reads every few minutes (SearchStore._corpus_stats) now
-- include the bigram count: this index replaces the one of migration 0003 for that index-only scan.
CREATE INDEX chunks_field_lengths_idx ON chunks (lexeme_count, bigram_count);
DROP INDEX chunks_lexeme_count_idx;
