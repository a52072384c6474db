"""indexer service: commits each document (or its deletion) to PostgreSQL in one transaction."""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.faults import crash_point
from ragstream.messages import ChunksEmbedded, DocumentDeleted, Topic
from ragstream.metrics import MESSAGES_IN, STAGE_LATENCY
from ragstream.service import Service, create_service_app

__all__ = ["create_app", "register_handlers"]

NAME = "indexer"


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(
        Topic.CHUNK_EMBEDDED.value,
        **options,
        title="chunk.embedded → indexer",
    )
    async def chunk_embedded(message: ChunksEmbedded, service: Service) -> None:
        MESSAGES_IN.labels(NAME, Topic.CHUNK_EMBEDDED.value).inc()
        with STAGE_LATENCY.labels(NAME).time():
            try:
                indexed = await service.runtime.indexer.run(message)
            except Exception as error:
                await service.fail(message.header, "index", error)
                return
            crash_point("indexer.after_commit")
            if indexed is not None:
                await service.publish(Topic.INDEXED, indexed, indexed.document_id)
        crash_point("indexer.after_publish")

    @broker.subscriber(
        Topic.DOC_DELETED.value,
        **options,
        title="doc.deleted → indexer",
    )
    async def doc_deleted(message: DocumentDeleted, service: Service) -> None:
        MESSAGES_IN.labels(NAME, Topic.DOC_DELETED.value).inc()
        with STAGE_LATENCY.labels(NAME).time():
            indexed = await service.runtime.indexer.delete(message)
            await service.publish(Topic.INDEXED, indexed, indexed.document_id)


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers)
