"""chunker service: parses staged documents and splits them into heading-aware chunk batches."""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.faults import crash_point
from ragstream.messages import DocumentChanged, Topic
from ragstream.metrics import MESSAGES_IN, STAGE_LATENCY
from ragstream.service import Service, create_service_app

__all__ = ["create_app", "register_handlers"]

NAME = "chunker"


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(
        Topic.DOC_CHANGED.value,
        **options,
        title="doc.changed → chunker",
    )
    async def doc_changed(message: DocumentChanged, service: Service) -> None:
        MESSAGES_IN.labels(NAME, Topic.DOC_CHANGED.value).inc()
        with STAGE_LATENCY.labels(NAME).time():
            try:
                batches = await service.runtime.chunker.run(message)
            except Exception as error:
                await service.fail(message.header, "chunk", error)
                return
            for batch in batches:
                await service.publish(Topic.DOC_CHUNKED, batch, batch.header.document_id)
        crash_point("chunker.after_publish")


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers)
