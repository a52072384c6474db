-- Retrieval scope and permissions: connection state, knowledge base, metadata and per-chunk ACLs,
-- BM25 term statistics, and citation numbers that stay stable within a conversation.

-- 'disabled' and 'archived' connections keep their rows but never appear in search.
ALTER TABLE connections ADD COLUMN status text NOT NULL DEFAULT 'active'
    CHECK (status IN ('active', 'disabled', 'archived'));
-- Fixed at creation: serve every chunk of this connection without per-user checks.
ALTER TABLE connections ADD COLUMN skip_acl boolean NOT NULL DEFAULT false;

ALTER TABLE documents ADD COLUMN knowledge_base text NOT NULL DEFAULT '';
ALTER TABLE documents ADD COLUMN url text;
ALTER TABLE documents ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}';
CREATE INDEX documents_metadata_idx ON documents USING gin (metadata jsonb_path_ops);

-- Principals allowed to see a chunk ('user:alice', 'group:eng'); NULL means everyone who can see
-- the connection. Kept per chunk so a permission change can rewrite it without re-embedding.
ALTER TABLE chunks ADD COLUMN acl text[];
CREATE INDEX chunks_acl_idx ON chunks USING gin (acl);
-- Number of lexemes in search_vector counted with repetitions: the BM25 document length.
ALTER TABLE chunks ADD COLUMN lexeme_count integer NOT NULL DEFAULT 0;

CREATE TABLE conversation_citations (
    conversation_id  text NOT NULL,
    document_id      text NOT NULL,
    citation_index   integer NOT NULL,
    assigned_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, document_id),
    UNIQUE (conversation_id, citation_index)
);
