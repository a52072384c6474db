"""Tests for the embedders in ``ragstream.embedding``."""
