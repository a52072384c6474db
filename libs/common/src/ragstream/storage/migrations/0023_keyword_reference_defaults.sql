-- The postings' reference BM25 parameters become the keyword leg's defaults (Settings.bm25_k1 0.4,
-- bm25_b 0.6, measured in docs/retrieval-quality.md), and every impact is rewritten under them.
-- 0017 stored impacts under k1 1.2, b 0.75: the postings only serve a search with the reference's
-- k1 and b (storage/postings.py), so with the default settings every search took the exact scan
-- (docs/benchmarks.md, "Hybrid search latency beside LlamaIndex at the PostgreSQL-docs size").
-- The row lock first, as keyword_refresh_impacts() takes it: a commit running meanwhile waits, then
-- writes its postings under the new parameters (its trigger reads them FOR KEY SHARE).
SELECT 1 FROM keyword_reference FOR UPDATE;
UPDATE keyword_reference SET k1 = 0.4, b = 0.6;
UPDATE keyword_postings p SET impact = keyword_impact(p.tf::integer,
        CASE p.field WHEN 0 THEN c.lexeme_count ELSE c.bigram_count END,
        CASE p.field WHEN 0 THEN r.average_words ELSE r.average_bigrams END, r.k1, r.b)
FROM chunks c, keyword_reference r
WHERE c.posting_key = p.chunk_key;
