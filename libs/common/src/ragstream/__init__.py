"""ragstream: sync knowledge sources into PostgreSQL + pgvector and serve hybrid retrieval."""

__all__: list[str] = []
