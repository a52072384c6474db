"""embedder service: ``doc.chunked`` in, ``chunk.embedded`` out."""
