-- Re-index without downtime. One embedding space is 'active': search embeds queries with its model and
-- ingest writes its vectors. A re-index fills a 'building' space from the committed chunk texts, then
-- switches it in and retires the old one (its table dropped). 'idle' spaces are side-by-side tables
-- nothing keeps up to date: their vectors are right (a chunk id never changes its text) but incomplete.
ALTER TABLE embedding_spaces ADD COLUMN status text NOT NULL DEFAULT 'idle'
    CHECK (status IN ('active', 'building', 'idle', 'retired'));
-- The embedder of the space (provider, model, dimension, base_url; never a key), so that a process
-- configured with another model can still embed queries and documents for it.
ALTER TABLE embedding_spaces ADD COLUMN spec jsonb;
-- At most one active and one building space, whichever process asks.
CREATE UNIQUE INDEX embedding_spaces_one_per_role_idx ON embedding_spaces (status)
    WHERE status IN ('active', 'building');

-- Re-index runs with their progress, written back while they run (like sync_runs).
CREATE TABLE reindex_runs (
    id               bigserial PRIMARY KEY,
    source_key       text,
    target_key       text NOT NULL,
    status           text NOT NULL CHECK (status IN ('running', 'switched', 'failed', 'interrupted')),
    error            text,
    chunks_total     integer NOT NULL DEFAULT 0,
    chunks_embedded  integer NOT NULL DEFAULT 0,
    rate             double precision,
    eta_seconds      double precision,
    started_at       timestamptz NOT NULL DEFAULT now(),
    heartbeat_at     timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz
);
