"""chunker service: ``doc.changed`` in, ``doc.chunked`` batches out."""
