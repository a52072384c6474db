"""retriever service: hybrid search over HTTP."""
