"""Live search through each platform's own search API, for connections with RAG off."""
