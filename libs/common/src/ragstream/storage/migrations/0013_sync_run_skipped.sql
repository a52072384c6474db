-- Entries a sync left out of its listing for a reason (symlinks, special files, unreadable ones).
ALTER TABLE sync_runs ADD COLUMN skipped integer NOT NULL DEFAULT 0;
