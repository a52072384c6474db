"""embedder service: turns chunk batches into packed float32 vectors with the configured model."""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.messages import ChunksEmbedded, DocumentChunked, Topic
from ragstream.service import Service, create_service_app

__all__ = ["create_app", "register_handlers"]

NAME = "embedder"


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(Topic.DOC_CHUNKED.value, **options, title="doc.chunked → embedder")
    async def doc_chunked(message: DocumentChunked, service: Service) -> None:
        async def embed() -> list[ChunksEmbedded]:
            return [await service.runtime.embed.run(message)]

        await service.process("embed", Topic.DOC_CHUNKED, message.header, embed, Topic.CHUNK_EMBEDDED)


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers, warm_up_embedder=True)
