"""HTTP API of the retriever, also served by the embedded runner."""
