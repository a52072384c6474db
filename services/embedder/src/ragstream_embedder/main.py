"""embedder service: turns chunk batches into packed float32 vectors with the configured model."""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.faults import crash_point
from ragstream.messages import DocumentChunked, Topic
from ragstream.metrics import MESSAGES_IN, STAGE_LATENCY
from ragstream.service import Service, create_service_app

__all__ = ["create_app", "register_handlers"]

NAME = "embedder"


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(
        Topic.DOC_CHUNKED.value,
        **options,
        title="doc.chunked → embedder",
    )
    async def doc_chunked(message: DocumentChunked, service: Service) -> None:
        MESSAGES_IN.labels(NAME, Topic.DOC_CHUNKED.value).inc()
        with STAGE_LATENCY.labels(NAME).time():
            try:
                embedded = await service.runtime.embed.run(message)
            except Exception as error:
                await service.fail(message.header, "embed", error)
                return
            await service.publish(Topic.CHUNK_EMBEDDED, embedded, embedded.header.document_id)
        crash_point("embedder.after_publish")


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers, warm_up_embedder=True)
