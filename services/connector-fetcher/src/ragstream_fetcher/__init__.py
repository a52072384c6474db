"""connector-fetcher service: syncs sources and announces changes on ``doc.changed`` / ``doc.deleted``."""
