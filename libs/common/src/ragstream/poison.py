"""Guards the Kafka consumers against messages they cannot decode: dead-lettered with a reason, then acked.

Without it, a message that fails to decode raises before any stage runs; the subscriber nacks it,
the consumer seeks back to it and reads it again, forever: the partition is stuck behind it, and
every document after it waits. ``PoisonGuard`` inspects each consumed message before its handler
and turns the three ways a message can be unreadable into a ``DeadLetter``:

* ``undecodable_message``: not UTF-8 JSON (random bytes, a truncated write, an empty tombstone);
* ``unsupported_schema_version``: a ``schema_version`` this build does not know (a newer producer,
  rolled out before its consumers). Retryable: once the consumers are upgraded, a replay of the
  failures re-drives the document from its staged content;
* ``invalid_message``: JSON that is not the topic's payload.

The dead letter names the topic, partition and offset, carries the key and value (up to
``PAYLOAD_LIMIT``), and the document's header when one can be read; with a header the failure is
also recorded on the document, so its sync run counts it failed instead of waiting for it, and
``POST /v1/replays`` can re-drive it. Then the message is acknowledged: the offset moves on. In a
batch (the embedder's subscriber), each poison record is dead-lettered alone and the handler gets the
others.
docs/faults.md describes this with the rest of the Kafka mode's faults and the tests that prove it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import asyncpg
from aiokafka import ConsumerRecord
from faststream import BaseMiddleware
from faststream.message import StreamMessage
from pydantic import BaseModel, ValidationError

from ragstream.failures import StageFailure, record_failure
from ragstream.messages import (
    SCHEMA_VERSION,
    ChunksEmbedded,
    DeadLetter,
    DocumentChanged,
    DocumentChunked,
    DocumentDeleted,
    DocumentHeader,
    MessageOrigin,
    Topic,
)
from ragstream.metrics import POISON_MESSAGES
from ragstream.runtime import Runtime

__all__ = [
    "CONSUMED",
    "PAYLOAD_LIMIT",
    "Consumed",
    "Poison",
    "PoisonCode",
    "PoisonGuard",
    "dead_letter",
    "inspect",
]

logger = logging.getLogger(__name__)

# A dead letter carries the rejected value so it can be published again; a bigger one (messages stay
# far below Kafka's 1 MB) is left out to keep the dead letter publishable, and the offset finds it.
PAYLOAD_LIMIT = 512 * 1024
_REDELIVERY_PAUSE_S = 1.0
_SUPPORTED_SCHEMA_VERSIONS = range(1, SCHEMA_VERSION + 1)


class PoisonCode(StrEnum):
    UNDECODABLE = "undecodable_message"
    UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
    INVALID = "invalid_message"


@dataclass(frozen=True, slots=True)
class Consumed:
    """The payload a topic carries and the stage (as failure rows name it) that consumes it."""

    payload: type[BaseModel]
    step: str


CONSUMED: dict[str, Consumed] = {
    Topic.DOC_CHANGED.value: Consumed(DocumentChanged, "chunk"),
    Topic.DOC_CHUNKED.value: Consumed(DocumentChunked, "embed"),
    Topic.CHUNK_EMBEDDED.value: Consumed(ChunksEmbedded, "index"),
    Topic.DOC_DELETED.value: Consumed(DocumentDeleted, "index"),
}


@dataclass(frozen=True, slots=True)
class Poison:
    """Why a consumed message was rejected, and what of it could be read."""

    code: PoisonCode
    reason: str
    origin: MessageOrigin
    header: DocumentHeader | None = None

    @property
    def retryable(self) -> bool:
        """Only a newer schema becomes readable later, with newer consumers; bad bytes stay bad."""
        return self.code is PoisonCode.UNSUPPORTED_SCHEMA_VERSION

    @property
    def key(self) -> str:
        """The dead letter's key: the document's when known, so its letters stay ordered."""
        if self.header is not None:
            return self.header.document_id
        if self.origin.key:
            return self.origin.key.decode(errors="replace")
        return f"{self.origin.topic}/{self.origin.partition}/{self.origin.offset}"


def inspect(expected: type[BaseModel], origin: MessageOrigin, value: bytes | None) -> Poison | None:
    """None when ``value`` decodes as ``expected`` in a supported schema version, else the reason."""

    def poison(code: PoisonCode, reason: str, header: DocumentHeader | None = None) -> Poison:
        return Poison(code, reason[:2000], origin, header)

    try:
        document = json.loads(value or b"")
    except (UnicodeDecodeError, ValueError) as error:
        return poison(PoisonCode.UNDECODABLE, f"not UTF-8 JSON: {error}")
    if not isinstance(document, dict):
        return poison(PoisonCode.INVALID, f"a JSON {type(document).__name__}, not an object")
    header = _header(document)
    version = document.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        return poison(PoisonCode.INVALID, f"schema_version {version!r} is not an integer", header)
    if version not in _SUPPORTED_SCHEMA_VERSIONS:
        supported = f"{_SUPPORTED_SCHEMA_VERSIONS.start}-{_SUPPORTED_SCHEMA_VERSIONS.stop - 1}"
        reason = f"schema_version {version} is not one this consumer reads ({supported})"
        return poison(PoisonCode.UNSUPPORTED_SCHEMA_VERSION, reason, header)
    try:
        expected.model_validate(document)
    except ValidationError as error:
        reason = f"not a {expected.__name__}: {error.error_count()} errors, first: {_first(error)}"
        return poison(PoisonCode.INVALID, reason, header)
    return None


def _header(document: dict[str, Any]) -> DocumentHeader | None:
    try:
        return DocumentHeader.model_validate(document.get("header"))
    except ValidationError:
        return None


def _first(error: ValidationError) -> str:
    first = error.errors(include_url=False, include_input=False)[0]
    return f"{'.'.join(str(part) for part in first['loc']) or '(message)'}: {first['msg']}"


class _Service(Protocol):
    """What dead-lettering needs of a service's context (``ragstream.service.ServiceContext``)."""

    @property
    def runtime(self) -> Runtime: ...

    async def publish(self, topic: Topic, message: Any, key: str) -> None: ...


async def dead_letter(service: _Service, poison: Poison, step: str) -> DeadLetter:
    """Record the failure on its document (when known) and publish the dead letter, acknowledged."""
    POISON_MESSAGES.labels(poison.origin.topic, poison.code.value).inc()
    retry_count = 0
    if poison.header is not None:
        failure = StageFailure(poison.code.value, poison.reason, poison.retryable)
        try:
            retry_count = (await record_failure(service.runtime.store, poison.header, step, failure)).retry_count
        except asyncpg.ForeignKeyViolationError:
            # The header names a connection this database does not know (deleted since, or never
            # ours): nothing to record it on, and retrying would not change that. The letter goes.
            logger.warning("poison message of unknown connection %s", poison.header.connection_id)
    letter = DeadLetter(
        header=poison.header,
        step=step,
        code=poison.code.value,
        message=poison.reason,
        retryable=poison.retryable,
        retry_count=retry_count,
        origin=poison.origin,
    )
    await service.publish(Topic.DEAD_LETTER, letter, poison.key)
    return letter


class PoisonGuard(BaseMiddleware):
    """Checks each consumed message before its handler; a poison one is dead-lettered and acked
    (the handler never sees it). A batch subscriber's handler gets the batch without its poison
    records, or is not called when every record was one. Needs the ``service`` context that
    ``create_service_app`` sets."""

    async def consume_scope(self, call_next: Any, msg: StreamMessage[Any]) -> Any:
        records = msg.raw_message
        if isinstance(records, ConsumerRecord):
            return None if await self._dead_lettered(records) else await call_next(msg)
        if isinstance(records, tuple | list):
            kept = [index for index, record in enumerate(records) if not await self._dead_lettered(record)]
            if not kept:
                return None
            if len(kept) < len(records):
                msg.raw_message = tuple(records[index] for index in kept)
                msg.body = [msg.body[index] for index in kept]
                msg.batch_headers = [msg.batch_headers[index] for index in kept]
                msg.clear_cache()
        return await call_next(msg)

    async def _dead_lettered(self, record: Any) -> bool:
        """True when ``record`` of a guarded topic is poison: then its dead letter is published."""
        consumed = CONSUMED.get(record.topic) if isinstance(record, ConsumerRecord) else None
        if consumed is None:
            return False
        value = record.value if record.value is None or isinstance(record.value, bytes) else bytes(record.value)
        key = record.key if record.key is None or isinstance(record.key, bytes) else bytes(record.key)
        carried = value if value is not None and len(value) <= PAYLOAD_LIMIT else None
        origin = MessageOrigin(
            topic=record.topic, partition=record.partition, offset=record.offset, key=key, payload=carried
        )
        poison = inspect(consumed.payload, origin, value)
        if poison is None:
            return False
        where = f"{record.topic}/{record.partition}@{record.offset}"
        logger.warning("dead-lettering %s: %s (%s)", where, poison.code, poison.reason)
        try:
            await dead_letter(self.context.get("service"), poison, consumed.step)
        except Exception:
            # PostgreSQL or Kafka is away: not acked, so read again; pause rather than spin meanwhile.
            await asyncio.sleep(_REDELIVERY_PAUSE_S)
            raise
        return True
