"""chunker service: parses staged documents and splits them into heading-aware chunk batches."""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.messages import DocumentChanged, Topic
from ragstream.service import Service, create_service_app

__all__ = ["create_app", "register_handlers"]

NAME = "chunker"


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(Topic.DOC_CHANGED.value, **options, title="doc.changed → chunker")
    async def doc_changed(message: DocumentChanged, service: Service) -> None:
        await service.process(
            "chunk", Topic.DOC_CHANGED, message.header, lambda: service.runtime.chunker.run(message), Topic.DOC_CHUNKED
        )


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers)
