-- True while a stage is still retrying the failure (a transient error, attempts left); false once it
-- gave up (recorded for good, dead-lettered). A sync waits for the former, not for the latter.
ALTER TABLE document_failures ADD COLUMN retrying boolean NOT NULL DEFAULT false;

-- Failures still open: their version is newer than what is committed (or nothing is). A commit of
-- the same or a newer version resolves a failure even before its row is cleaned up. The one
-- definition shared by the failure report, replay and a connection's sync_error summary.
CREATE VIEW open_document_failures AS
    SELECT f.* FROM document_failures f LEFT JOIN documents d ON d.id = f.document_id
    WHERE d.version IS NULL OR d.version < f.version;

-- How many times the committed version was retried before it indexed: transient failures that
-- healed within a stage's retries, or by a replay. The failure row that counted them is gone.
ALTER TABLE documents ADD COLUMN retry_count integer NOT NULL DEFAULT 0;

-- What a connection's status says went wrong: why its latest sync failed (if it did), then its
-- open document failures by code, e.g. '3 documents failed: 2 embedding_unavailable, 1 binary'.
-- Derived on read, so failures the Kafka stages record after the fetcher's run ended show too,
-- and a replay that resolves them clears the summary.
CREATE FUNCTION connection_sync_error(connection text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT nullif(concat_ws('; ',
        (SELECT sync_error FROM connections WHERE id = connection),
        (SELECT sum(n) || CASE WHEN sum(n) = 1 THEN ' document failed: ' ELSE ' documents failed: ' END
                || string_agg(n || ' ' || code, ', ' ORDER BY n DESC, code)
         FROM (SELECT code, count(*) AS n FROM open_document_failures WHERE connection_id = connection
               GROUP BY code) AS counts
         HAVING count(*) > 0)), '')
$$;
