"""The chunker, embedder and indexer services' handlers on real Kafka, in this process."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from faststream.kafka import KafkaBroker

from ragstream.kafka import consumer_options, create_broker, ensure_topics
from ragstream.runtime import Runtime
from ragstream.service import ServiceContext

__all__ = ["kafka_stages"]

_ASSIGNED_TIMEOUT_S = 60.0


@asynccontextmanager
async def kafka_stages(runtime: Runtime, bootstrap: str) -> AsyncIterator[KafkaBroker]:
    """The three stage services as their ``register_handlers`` declare them, over ``runtime`` (its
    stages may be test doubles), and a fetcher's broker to announce with; yields the latter.

    Each stage consumes in a consumer group of its own that starts at the end of the topics, so the
    messages other tests left on the shared broker never reach this database; it yields only once
    every partition is assigned and positioned, so nothing announced afterwards is missed."""
    from ragstream_chunker.main import register_handlers as chunker
    from ragstream_embedder.main import register_handlers as embedder
    from ragstream_indexer.main import register_handlers as indexer

    await ensure_topics(bootstrap)
    stages: list[tuple[str, Callable[[KafkaBroker, dict[str, Any]], None]]] = [
        ("chunker", chunker),
        ("embedder", embedder),
        ("indexer", indexer),
    ]
    run = uuid.uuid4().hex[:8]
    brokers: list[KafkaBroker] = []
    fetcher = create_broker(bootstrap, "connector-fetcher")
    try:
        for name, register in stages:
            broker = create_broker(bootstrap, name)
            brokers.append(broker)
            options = consumer_options(runtime.settings, name) | {
                "group_id": f"ragstream-{name}-{run}",
                "auto_offset_reset": "latest",
            }
            register(broker, options)
            broker.context.set_global("service", ServiceContext(name, runtime, broker))
            await broker.start()
        await fetcher.start()
        await _positioned(brokers)
        yield fetcher
    finally:
        await fetcher.stop()
        for broker in brokers:
            await broker.stop()


async def _positioned(brokers: list[KafkaBroker]) -> None:
    deadline = time.monotonic() + _ASSIGNED_TIMEOUT_S
    for broker in brokers:
        for subscriber in broker.subscribers:
            consumer = subscriber.consumer  # type: ignore[attr-defined]
            while not consumer.assignment():
                assert time.monotonic() < deadline, "the stage consumers were not assigned their partitions"
                await asyncio.sleep(0.1)
            for partition in consumer.assignment():
                await consumer.position(partition)
