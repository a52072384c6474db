-- The knowledge tool's hint: per conversation, how many searches in a row found nothing. After two,
-- the answer says the index may be stale and how to sync (a document added on the platform since
-- the last sync is not searchable yet). A search with results sets it back to 0.
CREATE TABLE IF NOT EXISTS conversation_search_streaks (
    conversation_id  text PRIMARY KEY,
    empty_searches   integer NOT NULL DEFAULT 0 CHECK (empty_searches >= 0),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
