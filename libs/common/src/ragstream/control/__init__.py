"""The control plane of syncs: runs and their progress in PostgreSQL, the runner and the scheduler."""
