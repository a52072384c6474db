-- BM25 corpus statistics: the keyword leg reads the number of chunks and their average lexeme
-- count every few minutes (SearchStore._corpus_stats). This index lets that aggregate be an
-- index-only scan of a few bytes per chunk instead of a scan of the chunks table with its text.
CREATE INDEX chunks_lexeme_count_idx ON chunks (lexeme_count);
