"""Kafka wiring shared by the services: broker factory, topic layout, and the publishing sink.

Stage logic never imports this module; services wrap stages with it, the embedded runner does not.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from faststream import BaseMiddleware
from faststream.kafka import KafkaBroker
from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware
from faststream.kafka.prometheus import KafkaPrometheusMiddleware
from faststream.middlewares import AckPolicy
from prometheus_client import REGISTRY
from pydantic import ValidationError

from ragstream.messages import DeadLetter, DocumentChanged, DocumentDeleted, Topic
from ragstream.metrics import CONSUMER_LAG, MESSAGES_OUT
from ragstream.settings import Settings
from ragstream.telemetry import tracer_provider

__all__ = ["KafkaChangeSink", "consumer_options", "create_broker", "dead_letters", "ensure_topics", "publish"]

logger = logging.getLogger(__name__)

# doc.changed is compacted: the newest change per document survives forever, so replaying the
# topic from the start rebuilds an index (a new model, a new chunker) without asking the sources.
_TOPIC_CONFIGS: dict[Topic, dict[str, str]] = {
    Topic.DOC_CHANGED: {"cleanup.policy": "compact"},
    Topic.DOC_DELETED: {"cleanup.policy": "compact"},
    Topic.DOC_CHUNKED: {"retention.ms": str(7 * 24 * 3600 * 1000)},
    Topic.CHUNK_EMBEDDED: {"retention.ms": str(7 * 24 * 3600 * 1000)},
    Topic.INDEXED: {"retention.ms": str(7 * 24 * 3600 * 1000)},
    Topic.DEAD_LETTER: {"retention.ms": str(30 * 24 * 3600 * 1000)},
}


class ConsumerLagMiddleware(BaseMiddleware):
    """Exports how far each consumed partition is behind its end, from the consumer's own fetch
    metadata, so it costs no extra request."""

    async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any) -> Any:
        consumer = getattr(msg, "consumer", None)
        records = msg.raw_message if isinstance(msg.raw_message, tuple) else (msg.raw_message,)
        if isinstance(consumer, AIOKafkaConsumer):
            group = getattr(consumer, "_group_id", None) or "none"
            for record in records:  # a batch's records in offset order per partition: the last one stays
                if isinstance(record, ConsumerRecord):
                    end = consumer.highwater(TopicPartition(record.topic, record.partition))
                    if end is not None:
                        lag = max(0, end - record.offset - 1)
                        CONSUMER_LAG.labels(group, record.topic, str(record.partition)).set(lag)
        return await call_next(msg)


def consumer_options(settings: Settings, service: str) -> dict[str, Any]:
    """Subscriber options every stage uses: its own group, offsets committed only after the handler
    returned (its output is then acknowledged by Kafka), and redelivery when it raised. A batch
    subscriber (the embedder's) takes up to ``ingest_workers`` messages at once; the others, one."""
    return {
        "group_id": f"ragstream-{service}",
        "max_records": settings.ingest_workers,
        "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.NACK_ON_ERROR,
        "session_timeout_ms": settings.kafka_session_timeout_ms,
        "heartbeat_interval_ms": max(500, settings.kafka_session_timeout_ms // 5),
    }


def create_broker(bootstrap_servers: str, service: str) -> KafkaBroker:
    """A broker whose producer waits for all in-sync replicas and never duplicates on retry, with
    trace context carried in message headers and Prometheus metrics for every subscriber."""
    return KafkaBroker(
        bootstrap_servers,
        client_id=f"ragstream-{service}",
        acks="all",
        enable_idempotence=True,
        max_request_size=1024 * 1024,
        # FastStream's own per-message lines ("Received", "Processed", a handler's error) go through the
        # process's handler (ragstream.logs) with the topic and message id as fields, not to stdout apart.
        logger=logging.getLogger("ragstream.kafka.messages"),
        middlewares=(
            ConsumerLagMiddleware,
            # A recording SDK provider, so every published message carries a W3C traceparent header
            # and a document can be followed from fetcher to indexer in logs and traces.
            KafkaTelemetryMiddleware(tracer_provider=tracer_provider(service)),
            KafkaPrometheusMiddleware(registry=REGISTRY, app_name=f"ragstream_{service.replace('-', '_')}"),
        ),
    )


async def ensure_topics(bootstrap_servers: str, partitions: int = 3, replication: int = 1) -> None:
    """Create the topics with their retention policies; existing topics are left as they are."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(topic.value, partitions, replication, topic_configs=config)
            for topic, config in _TOPIC_CONFIGS.items()
            if topic.value not in existing
        ]
        if missing:
            try:
                await admin.create_topics(missing)
            except TopicAlreadyExistsError:
                logger.info("another service created the topics first")
    finally:
        await admin.close()


async def publish(broker: KafkaBroker, service: str, topic: Topic, message: Any, key: str) -> None:
    """Publish keyed by document id and wait for the broker's acknowledgement (durable output)."""
    await broker.publish(message, topic.value, key=key.encode())
    MESSAGES_OUT.labels(service, topic.value).inc()


class KafkaChangeSink:
    """The fetch stage's output in distributed mode."""

    def __init__(self, broker: KafkaBroker) -> None:
        self._broker = broker

    async def changed(self, message: DocumentChanged) -> None:
        await publish(self._broker, "connector-fetcher", Topic.DOC_CHANGED, message, message.header.document_id)

    async def deleted(self, message: DocumentDeleted) -> None:
        await publish(self._broker, "connector-fetcher", Topic.DOC_DELETED, message, message.document_id)


async def dead_letters(bootstrap_servers: str) -> AsyncIterator[DeadLetter]:
    """Every dead letter on the topic, from its first retained offset to its end at the time of the call.

    Read without a consumer group, so replaying never moves anyone's offsets and can be repeated.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        described = await admin.describe_topics([Topic.DEAD_LETTER.value])
    finally:
        await admin.close()
    partitions = [
        TopicPartition(Topic.DEAD_LETTER.value, entry["partition"])
        for topic in described
        if topic["error_code"] == 0
        for entry in topic["partitions"]
    ]
    if not partitions:
        return
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        remaining = {partition for partition in partitions if ends[partition] > await consumer.position(partition)}
        while remaining:
            for partition, records in (await consumer.getmany(*remaining, timeout_ms=1000)).items():
                for record in records:
                    if record.offset < ends[partition] and record.value is not None:
                        try:
                            letter = DeadLetter.model_validate_json(record.value)
                        except ValidationError as error:  # not ours: one bad record must not stop a replay
                            logger.warning("skipping dead letter %s@%d: %s", partition, record.offset, error)
                            continue
                        yield letter
                if await consumer.position(partition) >= ends[partition]:
                    remaining.discard(partition)
    finally:
        await consumer.stop()
