-- Downloader/indexer split: each stage of a connection's sync keeps a cursor, so an interrupted sync
-- resumes where it stopped instead of starting over.

-- One row per connection and stage: 'download' is the fetcher's walk of the listing (it stages raw
-- content), 'index' the embedded runner's chunk, embed and commit of what was staged (in Kafka mode
-- the consumer groups' offsets are that stage's cursor). completed_at NULL: a walk in progress, which
-- the next sync resumes. direction: 'backward' until the stage has completed one walk (the first,
-- full sync), 'forward' after (incremental: only what changed is downloaded).
CREATE TABLE sync_cursors (
    connection_id  text NOT NULL REFERENCES connections (id) ON DELETE CASCADE,
    stage          text NOT NULL CHECK (stage IN ('download', 'index')),
    direction      text NOT NULL CHECK (direction IN ('backward', 'forward')),
    -- download: the last external id the walk finished (listings ascend by external id);
    -- index: the version it committed last.
    position       text,
    items          integer NOT NULL DEFAULT 0,
    started_at     timestamptz NOT NULL DEFAULT now(),
    completed_at   timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (connection_id, stage)
);

-- A staged version keeps the header it was announced with, so a resumed sync announces it again from
-- here instead of downloading it again. Rows staged before this migration have none and are not resumed.
ALTER TABLE staged_documents ADD COLUMN connection_id text;
ALTER TABLE staged_documents ADD COLUMN header jsonb;
CREATE INDEX staged_documents_connection_idx ON staged_documents (connection_id) WHERE header IS NOT NULL;

-- Which walk a run was, as its status shows it.
ALTER TABLE sync_runs ADD COLUMN direction text CHECK (direction IN ('backward', 'forward'));
ALTER TABLE sync_runs ADD COLUMN resumed boolean NOT NULL DEFAULT false;
