"""The AsyncAPI 3.0 document of every Kafka topic, its payload schemas taken from the pydantic models.

``make asyncapi`` (``python -m ragstream.asyncapi docs/asyncapi.json``) writes it; tests/test_asyncapi.py
compares the committed file with a fresh rendering, so a message model changed without regenerating
fails the suite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ragstream.messages import (
    SCHEMA_VERSION,
    ChunksEmbedded,
    DeadLetter,
    DocumentChanged,
    DocumentChunked,
    DocumentDeleted,
    DocumentIndexed,
    Topic,
)

__all__ = ["OPERATIONS", "PAYLOADS", "asyncapi_document", "render"]

# What each topic carries: one payload model per topic, keyed by document_id.
PAYLOADS: dict[Topic, type[BaseModel]] = {
    Topic.DOC_CHANGED: DocumentChanged,
    Topic.DOC_DELETED: DocumentDeleted,
    Topic.DOC_CHUNKED: DocumentChunked,
    Topic.CHUNK_EMBEDDED: ChunksEmbedded,
    Topic.INDEXED: DocumentIndexed,
    Topic.DEAD_LETTER: DeadLetter,
}
_PURPOSE = {
    Topic.DOC_CHANGED: "New or changed documents, their content staged in PostgreSQL. Log-compacted: replaying "
    "it from the start rebuilds every index.",
    Topic.DOC_DELETED: "Documents gone at their origin. Log-compacted.",
    Topic.DOC_CHUNKED: "Batches of a document's chunks, heading-aware.",
    Topic.CHUNK_EMBEDDED: "Batches of chunks with their vectors (packed little-endian float32, base64 in JSON).",
    Topic.INDEXED: "One per document version committed (or deleted, or found superseded) in PostgreSQL.",
    Topic.DEAD_LETTER: "Document versions that failed a stage for good, with the reason; "
    "POST /v1/replays (source dead-letter) publishes them to doc.changed again.",
}
# (service, action, topic): who publishes (send) and who consumes (receive) each topic.
OPERATIONS: list[tuple[str, Literal["send", "receive"], Topic]] = [
    ("connector-fetcher", "send", Topic.DOC_CHANGED),
    ("connector-fetcher", "send", Topic.DOC_DELETED),
    ("connector-fetcher", "receive", Topic.DEAD_LETTER),
    ("chunker", "receive", Topic.DOC_CHANGED),
    ("chunker", "send", Topic.DOC_CHUNKED),
    ("chunker", "send", Topic.DEAD_LETTER),
    ("embedder", "receive", Topic.DOC_CHUNKED),
    ("embedder", "send", Topic.CHUNK_EMBEDDED),
    ("embedder", "send", Topic.DEAD_LETTER),
    ("indexer", "receive", Topic.CHUNK_EMBEDDED),
    ("indexer", "receive", Topic.DOC_DELETED),
    ("indexer", "send", Topic.INDEXED),
    ("indexer", "send", Topic.DEAD_LETTER),
]
_KAFKA_BINDING = "0.5.0"


def _identifier(text: str) -> str:
    """AsyncAPI component keys allow letters, digits, ``_`` and ``-`` only."""
    return "".join(char if char.isalnum() or char in "_-" else "_" for char in text)


def _consumer_group(service: str) -> dict[str, Any]:
    return {"groupId": {"type": "string", "const": f"ragstream-{service}"}, "bindingVersion": _KAFKA_BINDING}


def asyncapi_document() -> dict[str, Any]:
    """The whole document as JSON-ready data."""
    _, definitions = models_json_schema(
        [(model, "serialization") for model in PAYLOADS.values()],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = definitions["$defs"]
    messages = {
        model.__name__: {
            "name": model.__name__,
            "title": model.__name__,
            "summary": (model.__doc__ or "").strip().splitlines()[0],
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{model.__name__}"},
            "bindings": {
                "kafka": {
                    "key": {"type": "string", "description": "document_id: one document's events stay ordered"},
                    "bindingVersion": _KAFKA_BINDING,
                }
            },
        }
        for model in PAYLOADS.values()
    }
    channels = {
        _identifier(topic.value): {
            "address": topic.value,
            "title": topic.value,
            "description": _PURPOSE[topic],
            "messages": {model.__name__: {"$ref": f"#/components/messages/{model.__name__}"}},
            "bindings": {"kafka": {"topic": topic.value, "bindingVersion": _KAFKA_BINDING}},
        }
        for topic, model in PAYLOADS.items()
    }
    operations = {
        _identifier(f"{service}_{action}s_{topic.value}"): {
            "action": action,
            "title": f"{service} {action}s {topic.value}",
            "channel": {"$ref": f"#/channels/{_identifier(topic.value)}"},
            "messages": [{"$ref": f"#/channels/{_identifier(topic.value)}/messages/{PAYLOADS[topic].__name__}"}],
            **({"bindings": {"kafka": _consumer_group(service)}} if action == "receive" else {}),
        }
        for service, action, topic in OPERATIONS
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "ragstream pipeline topics",
            "version": str(SCHEMA_VERSION),
            "description": "The Kafka topics between the ragstream services. Every message is JSON with a "
            "schema_version (consumers dead-letter a version they do not know) and is keyed by document_id. "
            "Generated from ragstream.messages by `make asyncapi`.",
        },
        "defaultContentType": "application/json",
        "servers": {
            "kafka": {
                "host": "kafka:9092",
                "protocol": "kafka",
                "description": "KAFKA_BOOTSTRAP_SERVERS of the deployment (docker-compose.yml: kafka:9092).",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": dict(sorted(schemas.items()))},
    }


def render() -> str:
    """The document as committed: indented JSON, one trailing newline."""
    return json.dumps(asyncapi_document(), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="where to write the document, e.g. docs/asyncapi.json")
    args = parser.parse_args()
    args.output.write_text(render(), encoding="utf-8")


if __name__ == "__main__":
    main()
