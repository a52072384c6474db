"""docs/asyncapi.json: current with the message models, every topic described, every reference resolved."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from faststream.kafka import KafkaBroker

from ragstream.asyncapi import OPERATIONS, PAYLOADS, asyncapi_document, render
from ragstream.messages import DeadLetter, DocumentHeader, Topic

DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "asyncapi.json"
STAGES = {
    "chunker": "ragstream_chunker.main",
    "embedder": "ragstream_embedder.main",
    "indexer": "ragstream_indexer.main",
}


def test_the_committed_document_is_current() -> None:
    assert DOCUMENT.read_text(encoding="utf-8") == render(), "stale docs/asyncapi.json: run `make asyncapi`"


def test_every_topic_is_a_channel_with_its_payload_model() -> None:
    channels = asyncapi_document()["channels"]
    addresses = {channel["address"]: channel for channel in channels.values()}
    assert set(addresses) == {topic.value for topic in Topic}
    assert {"indexed", "doc.dead-letter"} <= set(addresses)
    for topic, model in PAYLOADS.items():
        assert list(addresses[topic.value]["messages"]) == [model.__name__]


def _references(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _references(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _references(value)]
    return []


def test_every_reference_resolves() -> None:
    document = asyncapi_document()
    references = _references(document)
    assert references
    for reference in references:
        node: Any = document
        for part in reference.removeprefix("#/").split("/"):
            assert isinstance(node, dict) and part in node, f"{reference} does not resolve"
            node = node[part]


def test_a_dead_letter_on_the_wire_carries_the_documented_required_fields() -> None:
    header = DocumentHeader(
        document_id="d",
        connection_id="c",
        external_id="a.md",
        version=1,
        content_hash="h",
        title="A",
        source="a.md",
        media_type="text/markdown",
    )
    letter = DeadLetter(header=header, step="chunk", code="binary", message="m", retryable=False, retry_count=0)
    wire = json.loads(letter.model_dump_json())
    schema = asyncapi_document()["components"]["schemas"]["DeadLetter"]
    assert set(schema["required"]) <= set(wire)
    assert set(wire) <= set(schema["properties"])


@pytest.mark.parametrize("service", sorted(STAGES))
def test_the_receive_operations_match_the_subscribers_each_stage_registers(service: str) -> None:
    broker = KafkaBroker("127.0.0.1:1")  # never connected: only the declarations are read
    importlib.import_module(STAGES[service]).register_handlers(broker, {"group_id": f"ragstream-{service}"})
    subscribed = {topic for subscriber in broker.subscribers for topic in subscriber.topic_names}
    documented = {topic.value for name, action, topic in OPERATIONS if name == service and action == "receive"}
    assert subscribed == documented
