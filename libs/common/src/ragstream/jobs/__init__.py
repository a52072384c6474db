"""Long-running work over a transport: the sync job and the one progress type it reports."""
