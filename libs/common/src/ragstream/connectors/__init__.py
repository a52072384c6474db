"""Connectors bring documents in from where teams keep them: one module per platform."""
