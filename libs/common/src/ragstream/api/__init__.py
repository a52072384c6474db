"""HTTP and gRPC APIs of the retriever, also served by the embedded runner."""
