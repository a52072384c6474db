"""Tests of hybrid retrieval: the optional reranker and query rephraser over real HTTP."""
