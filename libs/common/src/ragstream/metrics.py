"""Prometheus metrics shared by every stage, whichever wiring runs it."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "CONNECTION_CHANGES",
    "CONSUMER_LAG",
    "DOCUMENTS_FAILED",
    "DOCUMENTS_RETRIED",
    "MESSAGES_IN",
    "MESSAGES_OUT",
    "POISON_MESSAGES",
    "SEARCH_LATENCY",
    "STAGE_LATENCY",
]

MESSAGES_IN = Counter("ragstream_messages_in_total", "Messages consumed", ["stage", "topic"])
MESSAGES_OUT = Counter("ragstream_messages_out_total", "Messages produced", ["stage", "topic"])
POISON_MESSAGES = Counter(
    "ragstream_poison_messages_total", "Consumed messages dead-lettered undecoded", ["topic", "code"]
)
DOCUMENTS_FAILED = Counter("ragstream_documents_failed_total", "Documents that failed a stage", ["stage", "code"])
DOCUMENTS_RETRIED = Counter(
    "ragstream_documents_retried_total", "Transient failures of a document retried within a stage", ["stage", "code"]
)
STAGE_LATENCY = Histogram(
    "ragstream_stage_seconds",
    "Time to handle one message in a stage",
    ["stage"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CONSUMER_LAG = Gauge(
    "ragstream_consumer_lag", "Messages behind the end of the partition", ["group", "topic", "partition"]
)
SEARCH_LATENCY = Histogram(
    "ragstream_search_seconds", "Hybrid search latency", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
)
CONNECTION_CHANGES = Counter(
    "ragstream_connection_changes_total", "Connections created, updated and deleted over the API", ["operation"]
)
