"""Shared test helpers: local servers and fakes."""
