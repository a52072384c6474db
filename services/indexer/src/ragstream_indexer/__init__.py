"""indexer service: ``chunk.embedded`` and ``doc.deleted`` in, ``indexed`` out."""
