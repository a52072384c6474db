-- One table for every long-running job: a sync, a re-index, a re-chunk, a replay is a run of its kind.
--
-- A run is queued, then claimed by one replica's runner, which makes it running and owns it: it holds a
-- session-level advisory lock keyed by the run id (storage/runs.py) for as long as it executes the run,
-- so any replica can tell a run whose owner died, and writes the progress document and the heartbeat
-- every few seconds. Any process may ask for a cancel (cancel_requested); the owner sees it at its
-- next heartbeat, stops the job and ends the run cancelled. One status vocabulary for every kind:
-- queued, running, then succeeded, failed or cancelled.
--
-- params: what the job needs (a re-index's target spec and keys, a re-chunk's chunking config and index
-- version, a replay's source). progress: its counts (per kind), total, done, rate and eta_seconds,
-- computed in one place (ragstream.jobs.progress).
CREATE TABLE runs (
    id                bigserial PRIMARY KEY,
    -- Any kind a runner registers (ragstream.control.kinds): a new kind needs no migration.
    kind              text NOT NULL,
    -- NULL: the deployment (a deployment-wide re-index, a replay of every connection).
    connection_id     text REFERENCES connections (id) ON DELETE CASCADE,
    trigger           text NOT NULL CHECK (trigger IN ('api', 'create', 'schedule', 'cli')),
    status            text NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    params            jsonb NOT NULL DEFAULT '{}',
    progress          jsonb NOT NULL DEFAULT '{}',
    error             text,
    cancel_requested  boolean NOT NULL DEFAULT false,
    -- The process executing it (host and pid), for people: liveness is the owner lock, not this.
    owner             text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    started_at        timestamptz,
    heartbeat_at      timestamptz,
    finished_at       timestamptz
);
-- At most one queued or running run per kind and scope, whichever replica asks: the 409 is the
-- database's unique violation, not a check-then-act race.
CREATE UNIQUE INDEX runs_one_active_idx ON runs (kind, coalesce(connection_id, '')) WHERE status IN ('queued', 'running');
CREATE INDEX runs_connection_idx ON runs (connection_id, kind, id DESC);
CREATE INDEX runs_kind_idx ON runs (kind, id DESC);
-- Runners claim the oldest queued run and count the running ones on every poll; without this the
-- growing history of finished runs would be scanned each time.
CREATE INDEX runs_active_idx ON runs (status, kind, id) WHERE status IN ('queued', 'running');

-- Upgrade in place: the sync runs keep their ids (the API has shown them), their counts become the
-- progress document; syncing is running, ready is succeeded. A run syncing now keeps its owner lock,
-- which is keyed by the same id.
INSERT INTO runs (id, kind, connection_id, trigger, status, progress, error, created_at, started_at, heartbeat_at,
                  finished_at)
SELECT id, 'sync', connection_id, trigger,
       CASE status WHEN 'syncing' THEN 'running' WHEN 'ready' THEN 'succeeded' ELSE status END,
       jsonb_build_object(
           'listed', listed, 'unchanged', unchanged, 'changed', changed, 'indexed', indexed,
           'deleted', deleted, 'failed', failed, 'chunks', chunks, 'skipped', skipped,
           'listing_done', listing_done, 'direction', direction, 'resumed', resumed,
           'total', listed, 'done', unchanged + indexed + failed, 'rate', rate, 'eta_seconds', eta_seconds),
       reason, created_at, started_at, heartbeat_at, finished_at
FROM sync_runs;
SELECT setval(pg_get_serial_sequence('runs', 'id'), coalesce((SELECT max(id) FROM runs), 0) + 1, false);
DROP TABLE sync_runs;
