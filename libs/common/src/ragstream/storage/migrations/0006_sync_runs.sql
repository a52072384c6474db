-- Runners claim the oldest queued run and count the running ones on every poll; without this the
-- growing history of finished runs would be scanned each time.
CREATE INDEX sync_runs_active_idx ON sync_runs (status, id) WHERE status IN ('queued', 'syncing');
