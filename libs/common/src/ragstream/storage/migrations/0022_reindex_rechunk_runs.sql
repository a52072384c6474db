-- Re-index and re-chunk runs join the runs table (migration 0021) and their own tables go. A switched
-- run succeeded; a failed one failed; one left running or interrupted is cancelled (its process is
-- gone with the old layout; starting it again resumes, as before). Their keys, config and index
-- version become params, their counts the progress document.
INSERT INTO runs (kind, connection_id, trigger, status, params, progress, error, created_at, started_at,
                  heartbeat_at, finished_at)
SELECT kind, connection_id, 'api', status, params, progress, error, started_at, started_at, heartbeat_at,
       coalesce(finished_at, heartbeat_at)
FROM (
    SELECT 'reindex' AS kind, connection_id, started_at, heartbeat_at, finished_at, error,
           CASE status WHEN 'switched' THEN 'succeeded' WHEN 'failed' THEN 'failed' ELSE 'cancelled' END AS status,
           jsonb_build_object('source_key', source_key, 'target_key', target_key) AS params,
           jsonb_build_object('chunks_total', chunks_total, 'chunks_embedded', chunks_embedded,
                              'total', chunks_total, 'done', chunks_embedded,
                              'rate', rate, 'eta_seconds', eta_seconds) AS progress
    FROM reindex_runs
    UNION ALL
    SELECT 'rechunk', connection_id, started_at, heartbeat_at, finished_at, error,
           CASE status WHEN 'switched' THEN 'succeeded' WHEN 'failed' THEN 'failed' ELSE 'cancelled' END,
           jsonb_build_object('index_version', index_version, 'chunking', chunking),
           jsonb_build_object('documents_total', documents_total, 'documents_done', documents_done,
                              'documents_failed', documents_failed, 'chunks', chunks,
                              'total', documents_total, 'done', documents_done,
                              'rate', rate, 'eta_seconds', eta_seconds)
    FROM rechunk_runs
) AS old
ORDER BY started_at;
DROP TABLE reindex_runs;
DROP TABLE rechunk_runs;
