-- Connections, documents, their chunks, per-model embedding spaces, staging and failures.
CREATE EXTENSION IF NOT EXISTS vector;

CREATE TABLE connections (
    id          text PRIMARY KEY,
    platform    text NOT NULL,
    name        text NOT NULL,
    config      jsonb NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- One sequence orders every change and deletion, so the indexer can drop anything older than
-- what it has committed, whatever stage or replica produced it.
CREATE SEQUENCE document_versions;

-- Raw content by reference: messages carry the version, never the bytes.
CREATE TABLE staged_documents (
    version      bigint PRIMARY KEY,
    document_id  text NOT NULL,
    content      bytea NOT NULL,
    staged_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX staged_documents_document_idx ON staged_documents (document_id);

-- The committed state: a row with status 'indexed' is searchable; 'deleted' is a tombstone that
-- keeps the version so a late, older change cannot resurrect the document.
CREATE TABLE documents (
    id              text PRIMARY KEY,
    connection_id   text NOT NULL REFERENCES connections (id) ON DELETE CASCADE,
    external_id     text NOT NULL,
    title           text NOT NULL,
    source          text NOT NULL,
    media_type      text NOT NULL,
    content_hash    text NOT NULL,
    source_version  text,
    version         bigint NOT NULL,
    status          text NOT NULL CHECK (status IN ('indexed', 'deleted')),
    chunk_count     integer NOT NULL DEFAULT 0,
    indexed_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (connection_id, external_id)
);

CREATE TABLE chunks (
    id             text PRIMARY KEY,
    document_id    text NOT NULL REFERENCES documents (id) ON DELETE CASCADE,
    ordinal        integer NOT NULL,
    heading        text NOT NULL,
    text           text NOT NULL,
    search_vector  tsvector NOT NULL,
    UNIQUE (document_id, ordinal)
);
CREATE INDEX chunks_search_vector_idx ON chunks USING gin (search_vector);

-- Each embedding model + dimension gets its own table (embeddings_<n>) with its own HNSW index,
-- so a 512-d local model and a 1024-d DashScope model can be indexed side by side.
CREATE TABLE embedding_spaces (
    model_key   text PRIMARY KEY,
    dimension   integer NOT NULL CHECK (dimension > 0),
    table_name  text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Batches of a multi-batch document wait here until all have arrived, then commit together.
CREATE TABLE pending_batches (
    document_id  text NOT NULL,
    version      bigint NOT NULL,
    batch_index  integer NOT NULL,
    batch_count  integer NOT NULL,
    payload      bytea NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (document_id, version, batch_index)
);

-- The latest failure of a document version that did not index; cleared when a newer version commits.
CREATE TABLE document_failures (
    document_id    text PRIMARY KEY,
    connection_id  text NOT NULL REFERENCES connections (id) ON DELETE CASCADE,
    source         text NOT NULL,
    version        bigint NOT NULL,
    step           text NOT NULL,
    code           text NOT NULL,
    message        text NOT NULL,
    retryable      boolean NOT NULL,
    retry_count    integer NOT NULL DEFAULT 0,
    failed_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX document_failures_connection_idx ON document_failures (connection_id);
