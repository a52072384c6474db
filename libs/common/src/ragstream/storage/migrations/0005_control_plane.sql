-- Control plane: connections managed over the API (encrypted credentials, RAG switch, schedule) and
-- sync runs with their status and progress, written back while they run.

-- A Fernet token (AES-128-CBC + HMAC-SHA256) of the connection's credentials JSON; never decrypted
-- outside the connector that needs it (ragstream.credentials).
ALTER TABLE connections ADD COLUMN credentials bytea;
-- Off: the connection stays for direct search at the platform, its chunks are removed.
ALTER TABLE connections ADD COLUMN rag_enabled boolean NOT NULL DEFAULT true;
-- Seconds between scheduled incremental syncs; 0 syncs only on request.
ALTER TABLE connections ADD COLUMN schedule_seconds integer NOT NULL DEFAULT 86400 CHECK (schedule_seconds >= 0);
-- The reason of the latest failed sync, cleared by the next one that succeeds.
ALTER TABLE connections ADD COLUMN sync_error text;
ALTER TABLE connections ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();

CREATE TABLE sync_runs (
    id             bigserial PRIMARY KEY,
    connection_id  text NOT NULL REFERENCES connections (id) ON DELETE CASCADE,
    trigger        text NOT NULL CHECK (trigger IN ('api', 'create', 'schedule', 'cli')),
    status         text NOT NULL CHECK (status IN ('queued', 'syncing', 'ready', 'failed')),
    reason         text,
    listed         integer NOT NULL DEFAULT 0,
    unchanged      integer NOT NULL DEFAULT 0,
    changed        integer NOT NULL DEFAULT 0,
    indexed        integer NOT NULL DEFAULT 0,
    deleted        integer NOT NULL DEFAULT 0,
    failed         integer NOT NULL DEFAULT 0,
    chunks         integer NOT NULL DEFAULT 0,
    listing_done   boolean NOT NULL DEFAULT false,
    rate           double precision,
    eta_seconds    double precision,
    created_at     timestamptz NOT NULL DEFAULT now(),
    started_at     timestamptz,
    heartbeat_at   timestamptz,
    finished_at    timestamptz
);
-- At most one queued or running sync per connection, whichever replica asks: the 409 is the
-- database's unique violation, not a check-then-act race.
CREATE UNIQUE INDEX sync_runs_one_active_idx ON sync_runs (connection_id) WHERE status IN ('queued', 'syncing');
CREATE INDEX sync_runs_connection_idx ON sync_runs (connection_id, id DESC);
