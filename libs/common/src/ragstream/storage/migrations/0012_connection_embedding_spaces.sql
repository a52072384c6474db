-- Per-connection embedding models. A connection follows the deployment's active embedding space
-- (embedding_model_key NULL) or is pinned to a space of its own (the model key). Its *effective* space
-- is that pinned key, else the active one, and the vectors search reads of its chunks live in that
-- space's table only: search runs one vector leg per effective space in scope, each restricted to its
-- connections; commits refuse vectors of any other model except the connection's re-index target.
-- Pinned spaces other than the active one are 'idle' (migration 0007): kept, not the default.
--
-- A per-connection re-index fills the target table with that connection's chunks beside the current
-- ones, then in one transaction holding the connection row FOR UPDATE (commits hold it FOR KEY SHARE)
-- embeds the last stragglers, sets embedding_model_key and deletes the connection's vectors from the
-- old table, or drops the old table when nothing uses it any more.
ALTER TABLE connections ADD COLUMN embedding_model_key text REFERENCES embedding_spaces (model_key);
CREATE INDEX connections_embedding_model_key_idx ON connections (embedding_model_key)
    WHERE embedding_model_key IS NOT NULL;

-- NULL: a deployment-wide re-index (of the connections following the default); else that connection's.
ALTER TABLE reindex_runs ADD COLUMN connection_id text REFERENCES connections (id) ON DELETE CASCADE;
CREATE INDEX reindex_runs_connection_idx ON reindex_runs (connection_id, id DESC);
