"""indexer service: commits each document (or its deletion) to PostgreSQL in one transaction."""

from __future__ import annotations

from typing import Any

from faststream.asgi import AsgiFastStream
from faststream.kafka import KafkaBroker

from ragstream.messages import ChunksEmbedded, DocumentChanged, DocumentDeleted, DocumentIndexed, Topic
from ragstream.metrics import MESSAGES_IN
from ragstream.service import Service, create_service_app
from ragstream.transport.document import STALE_ERRORS, DocumentAttempt, DocumentRun

__all__ = ["create_app", "register_handlers"]

NAME = "indexer"


def register_handlers(broker: KafkaBroker, options: dict[str, Any]) -> None:
    @broker.subscriber(Topic.CHUNK_EMBEDDED.value, **options, title="chunk.embedded → indexer")
    async def chunk_embedded(message: ChunksEmbedded, service: Service) -> None:
        async def index() -> list[DocumentIndexed]:
            runtime = service.runtime
            try:
                indexed = await runtime.indexer.run(message)
            except STALE_ERRORS as refused:
                # Made before a re-chunk or re-index switch: run it again here, whole, as up does.
                rerun = DocumentRun(runtime.chunker, runtime.embed, runtime.indexer)
                return await rerun.rerun(DocumentChanged(header=message.header), refused, DocumentAttempt())
            return [indexed] if indexed is not None else []  # None: batches of the document still missing

        await service.process("index", Topic.CHUNK_EMBEDDED, message.header, index, Topic.INDEXED)

    @broker.subscriber(Topic.DOC_DELETED.value, **options, title="doc.deleted → indexer")
    async def doc_deleted(message: DocumentDeleted, service: Service) -> None:
        # A deletion has no content that could fail; errors here are infrastructure and redeliver.
        MESSAGES_IN.labels(NAME, Topic.DOC_DELETED.value).inc()
        indexed = await service.runtime.indexer.delete(message)
        await service.publish(Topic.INDEXED, indexed, indexed.document_id)


def create_app() -> AsgiFastStream:
    return create_service_app(NAME, register_handlers)
