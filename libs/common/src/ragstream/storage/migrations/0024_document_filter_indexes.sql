-- A search filtered by knowledge base or source finds the documents, then their chunks (by the
-- (document_id, index_version, ordinal) key), before scoring them: the keyword leg's scope-first
-- scan (storage/search.py, _SCOPE_FIRST). Without these indexes a narrow filter read every document
-- (195k at a million chunks) to find its own.
-- (Metadata filters have documents_metadata_idx since 0002; connections, documents' unique key.)
CREATE INDEX documents_knowledge_base_idx ON documents (knowledge_base);
CREATE INDEX documents_source_idx ON documents (source);
