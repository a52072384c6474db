"""embedder service: turns chunk batches into packed float32 vectors with the configured model.

It consumes ``doc.chunked`` in batches of up to ``max_records`` messages (``RAGSTREAM_INGEST_WORKERS``,
the embedded pipeline's documents in flight) and embeds their documents at once, so the chunks of
many documents share the provider's calls as they do in the embedded mode (docs/ingest.md). The
offsets of a batch are committed once every message of it is published or recorded failed.
"""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.messages import ChunksEmbedded, DocumentChunked, Topic
from ragstream.service import Service, create_service_app

__all__ = ["BATCH_WAIT_MS", "create_app", "register_handlers"]

NAME = "embedder"
BATCH_WAIT_MS = 50
"""How long an idle consumer waits for a first message before it polls again."""


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(
        Topic.DOC_CHUNKED.value, **options, batch=True, batch_timeout_ms=BATCH_WAIT_MS, title="doc.chunked → embedder"
    )
    async def doc_chunked(messages: list[DocumentChunked], service: Service) -> None:
        async def embed(message: DocumentChunked) -> list[ChunksEmbedded]:
            return [await service.runtime.embed.run(message)]

        await service.process_batch("embed", Topic.DOC_CHUNKED, messages, embed, Topic.CHUNK_EMBEDDED)


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers, warm_up_embedder=True)
