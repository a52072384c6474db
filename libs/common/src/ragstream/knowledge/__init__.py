"""The knowledge tool: one endpoint for search, read, list_documents, create and update, per platform."""
