"""Every Prometheus metric of ragstream, whichever wiring runs it, and their exposition on ``/metrics``.

Labels stay of low cardinality: stages, topics, outcomes and error codes, never a document or
connection id (the logs carry those, see :mod:`ragstream.logs`).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

__all__ = [
    "ADMISSION_REJECTIONS",
    "CHUNKS_INDEXED",
    "CONNECTION_CHANGES",
    "CONSUMER_LAG",
    "DB_POOL_WAIT",
    "DOCUMENTS_FAILED",
    "DOCUMENTS_INDEXED",
    "DOCUMENTS_RETRIED",
    "MESSAGES_IN",
    "MESSAGES_OUT",
    "POISON_MESSAGES",
    "RUNS_FINISHED",
    "SEARCH_LATENCY",
    "SEARCH_REQUESTS",
    "STAGE_LATENCY",
    "VENDOR_REQUESTS",
    "VENDOR_REQUEST_SECONDS",
    "exposition",
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
DOCUMENTS_INDEXED = Counter(
    "ragstream_documents_indexed_total",
    "Document versions the index committed: indexed, deleted, or stale (a newer version was there first)",
    ["outcome"],
)
CHUNKS_INDEXED = Counter("ragstream_chunks_indexed_total", "Chunks committed to the index with their vectors")
KEYWORD_SEARCHES = Counter(
    "ragstream_keyword_searches_total",
    "Keyword-leg searches by the path that answered: postings (rounds), postings: whole lists, exact: <why>",
    ["path"],
)
KEYWORD_LISTS_LOADED = Counter("ragstream_keyword_lists_loaded_total", "Term lists the keyword leg read into memory")
KEYWORD_LISTS_BYTES = Gauge("ragstream_keyword_lists_bytes", "Memory of the term lists the keyword leg keeps")
SEARCH_REQUESTS = Counter(
    "ragstream_search_requests_total",
    "Search calls by API (http, grpc) and outcome (ok, overloaded, db_busy, timeout, cancelled, error)",
    ["api", "outcome"],
)
ADMISSION_REJECTIONS = Counter(
    "ragstream_search_rejections_total",
    "Searches refused by admission control: queue_full (too many waiting) or wait_timeout (no turn in time)",
    ["reason"],
)
DB_POOL_WAIT = Histogram(
    "ragstream_db_pool_wait_seconds",
    "Wait for a database pool connection, including waits that timed out",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RUNS_FINISHED = Counter(
    "ragstream_runs_finished_total",
    "Runs (sync, reindex, rechunk, replay...) this process ended, by kind and final status",
    ["kind", "status"],
)
VENDOR_REQUESTS = Counter(
    "ragstream_vendor_requests_total",
    "HTTP requests to a vendor (platform or model API) by outcome: the status class (2xx, 4xx, 5xx...),"
    " timeout or network",
    ["vendor", "outcome"],
)
VENDOR_REQUEST_SECONDS = Histogram(
    "ragstream_vendor_request_seconds",
    "Time of one HTTP request to a vendor, each attempt apart, failed ones included",
    ["vendor"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def exposition(accept: str | None) -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answer to a scrape sending ``accept``: the
    Prometheus text format, or OpenMetrics when the scraper asks for it."""
    encode, content_type = choose_encoder(accept or "")
    return encode(REGISTRY), content_type
