"""The Kafka wiring against a real broker: topic policies, keys, and trace context in headers."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer  # type: ignore[import-untyped]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType  # type: ignore[import-untyped]

from ragstream.kafka import KafkaChangeSink, create_broker, ensure_topics
from ragstream.messages import DocumentDeleted, Topic

pytestmark = pytest.mark.kafka


async def test_topics_are_created_with_doc_changed_compacted(kafka_bootstrap: str) -> None:
    await ensure_topics(kafka_bootstrap)
    await ensure_topics(kafka_bootstrap)  # a second service starting finds them in place
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        assert {topic.value for topic in Topic} <= set(await admin.list_topics())
        described = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, Topic.DOC_CHANGED.value)])
        configs = {entry[0]: entry[1] for entry in described[0].resources[0][4]}
        assert configs["cleanup.policy"] == "compact"
    finally:
        await admin.close()


async def test_published_changes_are_keyed_by_document_and_carry_a_trace(kafka_bootstrap: str) -> None:
    await ensure_topics(kafka_bootstrap)
    broker = create_broker(kafka_bootstrap, "connector-fetcher")
    await broker.start()
    document_id = uuid.uuid4().hex
    consumer = AIOKafkaConsumer(
        Topic.DOC_DELETED.value, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", group_id=document_id
    )
    try:
        message = DocumentDeleted(document_id=document_id, connection_id="c", external_id="e", source="s", version=7)
        await KafkaChangeSink(broker).deleted(message)
        await consumer.start()
        async for record in consumer:
            if record.key == document_id.encode():
                break
        assert DocumentDeleted.model_validate_json(record.value) == message
        assert any(name == "traceparent" for name, _ in record.headers)
    finally:
        await consumer.stop()
        await broker.stop()
