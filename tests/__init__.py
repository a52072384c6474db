"""Test suite for ragstream."""
