-- Sync runs need to know whether a connection may be synced at all: the scheduler only acts on
-- active connections. Free text on purpose (active, paused, ...): the connections API owns its values.
ALTER TABLE connections ADD COLUMN IF NOT EXISTS status text NOT NULL DEFAULT 'active';
-- The runner claims the oldest queued run and the stale check scans running ones.
CREATE INDEX sync_runs_status_idx ON sync_runs (status, id) WHERE status IN ('queued', 'syncing');
