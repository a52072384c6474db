"""The scaffold every Kafka service shares: lifespan, per-process context, failure routing, probes.

A service module only declares its subscribers (``register`` callback) on typed messages; opening
the pool, creating topics, starting the broker and serving ``/healthz``, ``/readyz`` and
``/metrics`` happen here, so the five services cannot drift apart in how they start or fail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Protocol, TypeVar

import asyncpg
from aiokafka.errors import KafkaError
from faststream import Context
from faststream.asgi import AsgiFastStream, AsgiResponse, get, make_ping_asgi
from faststream.kafka import KafkaBroker
from pydantic import BaseModel

from ragstream.failures import classify, is_transient, record_failure, record_retry
from ragstream.faults import crash_point
from ragstream.kafka import consumer_options, create_broker, ensure_topics, publish
from ragstream.logs import configure_logging, log_context
from ragstream.messages import DeadLetter, DocumentHeader, Topic
from ragstream.metrics import MESSAGES_IN, STAGE_LATENCY, exposition
from ragstream.poison import PoisonGuard
from ragstream.runtime import Runtime, open_runtime
from ragstream.settings import Settings

__all__ = ["INFRASTRUCTURE_ERRORS", "Service", "ServiceContext", "create_service_app"]

logger = logging.getLogger(__name__)
_REDELIVERY_PAUSE_S = 1.0

# Errors of the machinery around a document, not of the document: the message is not acked and is
# delivered again once PostgreSQL or Kafka is back, instead of being recorded as a failed document.
# A PostgreSQL restart terminates every session (AdminShutdownError, 57P01; CrashShutdownError after
# another backend crashed), and a connection cut mid-query can leave asyncpg's protocol in a state
# it reports as InternalClientError: none of them says anything about the document.
INFRASTRUCTURE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    KafkaError,
)


class _DocumentMessage(Protocol):
    """A consumed message about one document (every stage's input but a deletion)."""

    @property
    def header(self) -> DocumentHeader: ...


_Message = TypeVar("_Message", bound=_DocumentMessage)


@dataclass(frozen=True, slots=True)
class ServiceContext:
    """Per-process singletons handed to handlers through FastStream's context as ``service``."""

    name: str
    runtime: Runtime
    broker: KafkaBroker

    async def publish(self, topic: Topic, message: Any, key: str) -> None:
        await publish(self.broker, self.name, topic, message, key)

    async def process(
        self,
        step: str,
        consumed: Topic,
        header: DocumentHeader,
        produce: Callable[[], Awaitable[Sequence[BaseModel]]],
        produced: Topic,
    ) -> None:
        """One message of a stage: run it (retrying a transient failure with backoff, each retry
        counted on the document), publish its outputs (each acknowledged by Kafka) or record its
        failure and dead-letter it; the handler returns only then, so the offset is committed after
        durable output. Everything logged meanwhile carries the document's and its connection's ids."""
        MESSAGES_IN.labels(self.name, consumed.value).inc()

        async def retrying(error: Exception) -> None:
            await record_retry(self.runtime.store, header, step, error)

        with (
            log_context(connection_id=header.connection_id, document_id=header.document_id),
            STAGE_LATENCY.labels(self.name).time(),
        ):
            try:
                outputs = await self.runtime.stage_retry().run(produce, retrying, _retried_here)
            except Exception as error:
                await self.fail(header, step, error)
                return
            crash_point(f"{self.name}.before_publish")
            for output in outputs:
                await self.publish(produced, output, header.document_id)
        crash_point(f"{self.name}.after_publish")

    async def process_batch(
        self,
        step: str,
        consumed: Topic,
        messages: Sequence[_Message],
        produce: Callable[[_Message], Awaitable[Sequence[BaseModel]]],
        produced: Topic,
    ) -> None:
        """A batch subscriber's messages, each through ``process``: the messages of one document in
        the order consumed (its outputs stay ordered under its key), different documents at once, so
        their calls can share a provider's batches. Returns when every message's output is published
        or its failure recorded; an infrastructure error cancels the rest and propagates, and the
        whole batch is delivered again."""
        by_document: dict[str, list[_Message]] = {}
        for message in messages:
            by_document.setdefault(message.header.document_id, []).append(message)

        async def in_order(document: list[_Message]) -> None:
            for message in document:
                await self.process(step, consumed, message.header, partial(produce, message), produced)

        try:
            async with asyncio.TaskGroup() as group:
                for document in by_document.values():
                    group.create_task(in_order(document))
        except ExceptionGroup as errors:  # the first document's error, as ``process`` raises it
            raise errors.exceptions[0] from None

    async def fail(self, header: DocumentHeader, step: str, error: Exception) -> None:
        """Record a document's failure as a row and a dead letter; infrastructure errors propagate."""
        if isinstance(error, INFRASTRUCTURE_ERRORS):
            # Not acked, so redelivered: pause first rather than spin while PostgreSQL restarts.
            await asyncio.sleep(_REDELIVERY_PAUSE_S)
            raise error
        failure = classify(error)
        retry_count = 0
        try:
            retry_count = (await record_failure(self.runtime.store, header, step, failure)).retry_count
        except asyncpg.ForeignKeyViolationError:
            # Its connection was deleted while the document was in flight: no row can name it, and
            # raising would redeliver the message forever. The dead letter still tells.
            logger.warning("document %s of deleted connection %s", header.source, header.connection_id)
        logger.warning("document %s failed at %s: %s", header.source, step, failure.code)
        dead = DeadLetter(
            header=header,
            step=step,
            code=failure.code,
            message=failure.message,
            retryable=failure.retryable,
            retry_count=retry_count,
        )
        await self.publish(Topic.DEAD_LETTER, dead, header.document_id)


def _retried_here(error: BaseException) -> bool:
    """Transient document errors are retried in the stage; infrastructure errors are not: the
    message is redelivered once PostgreSQL or Kafka is back, and nothing is recorded for it."""
    return is_transient(error) and not isinstance(error, INFRASTRUCTURE_ERRORS)


Service = Annotated[ServiceContext, Context("service")]
"""A handler parameter of this type receives the process's ``ServiceContext``."""


def create_service_app(
    name: str,
    register: Callable[[KafkaBroker, dict[str, Any]], None],
    *,
    routes: Sequence[tuple[str, Any]] = (),
    settings: Settings | None = None,
    warm_up_embedder: bool = False,
) -> AsgiFastStream:
    """Build the ASGI app of one service: ``uvicorn module:create_app --factory`` serves it."""
    config = settings or Settings()
    configure_logging(config.logs)
    broker = create_broker(config.kafka_bootstrap_servers, name)
    broker.add_middleware(PoisonGuard)  # innermost: a message reaches a handler only once it decodes
    register(broker, consumer_options(config, name))
    ready = {"value": False}

    @asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        if not config.database_url:
            raise RuntimeError("DATABASE_URL must be set for a distributed service")
        await ensure_topics(config.kafka_bootstrap_servers)
        async with open_runtime(config, config.database_url) as runtime:
            if warm_up_embedder:
                await runtime.embedder.warm_up()
            broker.context.set_global("service", ServiceContext(name, runtime, broker))
            ready["value"] = True
            try:
                yield
            finally:
                ready["value"] = False

    @get
    async def readyz(scope: Any) -> AsgiResponse:
        return AsgiResponse(b"ready" if ready["value"] else b"starting", status_code=200 if ready["value"] else 503)

    @get
    async def metrics(scope: Any) -> AsgiResponse:
        accept = dict(scope.get("headers", ())).get(b"accept", b"").decode("latin-1")
        body, content_type = exposition(accept)
        return AsgiResponse(body, headers={"content-type": content_type})

    return AsgiFastStream(
        broker,
        lifespan=lifespan,
        asgi_routes=[
            ("/healthz", make_ping_asgi(broker, timeout=5.0)),
            ("/readyz", readyz),
            ("/metrics", metrics),
            *routes,
        ],
    )
