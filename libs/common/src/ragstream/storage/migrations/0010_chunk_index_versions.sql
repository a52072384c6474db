-- Re-chunk without downtime: a connection's chunking config changes, its index is rebuilt beside the
-- old one and switched in atomically.
--
-- Every chunk belongs to one index version of its connection (chunks.index_version); search reads
-- only the connection's active one (connections.index_version, a clause of every retrieval leg). A
-- re-chunk run builds version N+1 next to N: each indexed document is chunked again from its committed
-- staged content (the version's content is kept for replays) with the new config and embedded in the
-- active embedding space, one transaction per document, while search goes on reading version N.
-- Ingest meanwhile keeps chunking with the old config and commits at version N; a commit replaces all
-- of the document's chunks, whatever their version, so an edited document has no N+1 chunks any more
-- and the run rebuilds it again from its new content. Chunks made for a version that is no longer
-- active when they commit are refused (retryable, chunked again), so no old-config chunk lands in N+1.
-- When every indexed document has N+1 chunks, one transaction holding the connection row FOR UPDATE
-- (commits hold it FOR KEY SHARE, so they wait for it and it for them) rebuilds the last documents
-- changed since the last pass, makes N+1 active with its config, and deletes every other version's
-- chunks (their vectors go by ON DELETE CASCADE). A failed, cancelled or crashed run leaves N active
-- and searchable; a rerun with the same config resumes N+1 and skips the documents already rebuilt.
ALTER TABLE connections ADD COLUMN index_version integer NOT NULL DEFAULT 0;
ALTER TABLE chunks ADD COLUMN index_version integer NOT NULL DEFAULT 0;
-- Two versions of one document's chunks exist side by side while a run builds.
ALTER TABLE chunks DROP CONSTRAINT chunks_document_id_ordinal_key;
ALTER TABLE chunks ADD CONSTRAINT chunks_document_index_version_ordinal_key UNIQUE (document_id, index_version, ordinal);

-- Re-chunk runs with their progress, written back while they run (like sync_runs and reindex_runs).
CREATE TABLE rechunk_runs (
    id                bigserial PRIMARY KEY,
    connection_id     text NOT NULL REFERENCES connections (id) ON DELETE CASCADE,
    index_version     integer NOT NULL,
    chunking          jsonb NOT NULL,
    status            text NOT NULL CHECK (status IN ('running', 'switched', 'failed', 'interrupted')),
    error             text,
    documents_total   integer NOT NULL DEFAULT 0,
    documents_done    integer NOT NULL DEFAULT 0,
    documents_failed  integer NOT NULL DEFAULT 0,
    chunks            integer NOT NULL DEFAULT 0,
    rate              double precision,
    eta_seconds       double precision,
    started_at        timestamptz NOT NULL DEFAULT now(),
    heartbeat_at      timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
);
CREATE INDEX rechunk_runs_connection_idx ON rechunk_runs (connection_id, id DESC);
