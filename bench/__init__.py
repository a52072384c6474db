"""Benchmarks of ragstream on real corpora: ``python -m bench.ingest`` (see bench/README.md)."""
