-- Contextual retrieval: the line a chat model wrote to place a chunk in its document, cached by a
-- digest of the model, the document title, the heading path and the chunk text. A re-sync, re-chunk
-- or re-index of an unchanged chunk reads it here instead of asking the model again.
CREATE TABLE IF NOT EXISTS chunk_contexts (
    digest bytea PRIMARY KEY,
    context text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
