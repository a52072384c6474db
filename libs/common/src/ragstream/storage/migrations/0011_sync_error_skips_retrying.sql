-- A connection's failure summary counts only the documents that failed for good: a failure a stage
-- is still retrying (retrying = true) may yet index, so '... documents failed' must not include it.
-- Otherwise as in 0009.
CREATE OR REPLACE FUNCTION connection_sync_error(connection text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT nullif(concat_ws('; ',
        (SELECT sync_error FROM connections WHERE id = connection),
        (SELECT sum(n) || CASE WHEN sum(n) = 1 THEN ' document failed: ' ELSE ' documents failed: ' END
                || string_agg(n || ' ' || code, ', ' ORDER BY n DESC, code)
         FROM (SELECT code, count(*) AS n FROM open_document_failures
               WHERE connection_id = connection AND NOT retrying
               GROUP BY code) AS counts
         HAVING count(*) > 0)), '')
$$;
