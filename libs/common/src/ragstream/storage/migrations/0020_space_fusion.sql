-- Fusion weights belong to the embedding space: the weights that fuse a space's vector leg with the
-- keyword leg (an RRF or convex config as JSON), set by an operator or the tuning command. NULL: the
-- weights measured for the space's model, else the deployment's.
ALTER TABLE embedding_spaces ADD COLUMN IF NOT EXISTS fusion jsonb;
