"""How ``ragstream.poison.inspect`` judges a consumed message, per topic payload (pure, no broker)."""

from __future__ import annotations

import json

import pytest
from faststream.kafka import KafkaBroker, TestKafkaBroker
from pydantic import BaseModel

from ragstream.messages import (
    SCHEMA_VERSION,
    ChunkPayload,
    DeadLetter,
    DocumentChanged,
    DocumentChunked,
    DocumentDeleted,
    DocumentHeader,
    MessageOrigin,
    Topic,
)
from ragstream.poison import CONSUMED, PoisonCode, PoisonGuard, inspect

HEADER = DocumentHeader(
    document_id="doc-1",
    connection_id="conn-1",
    external_id="a.md",
    version=7,
    content_hash="0" * 64,
    title="A",
    source="a.md",
    media_type="text/markdown",
)
CHANGED = DocumentChanged(header=HEADER).model_dump(mode="json")
CHUNKED = DocumentChunked(
    header=HEADER, batch_index=0, batch_count=1, chunk_count=1, chunks=[ChunkPayload(ordinal=0, heading="", text="x")]
).model_dump(mode="json")
ORIGIN = MessageOrigin(topic="doc.changed", partition=2, offset=41, key=b"doc-1", payload=b"...")


def encoded(document: object) -> bytes:
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("expected", "value", "code", "has_header"),
    [
        (DocumentChanged, b"\xff\xfe\x00garbage", PoisonCode.UNDECODABLE, False),
        (DocumentChanged, b"", PoisonCode.UNDECODABLE, False),
        (DocumentChanged, None, PoisonCode.UNDECODABLE, False),
        (DocumentChanged, b'{"header": {"document_id": ', PoisonCode.UNDECODABLE, False),
        (DocumentChanged, encoded([1, 2, 3]), PoisonCode.INVALID, False),
        (DocumentChanged, encoded({"kind": "changed", "hello": "world"}), PoisonCode.INVALID, False),
        (DocumentChanged, encoded({**CHANGED, "schema_version": "2"}), PoisonCode.INVALID, True),
        (
            DocumentChanged,
            encoded({**CHANGED, "schema_version": SCHEMA_VERSION + 1}),
            PoisonCode.UNSUPPORTED_SCHEMA_VERSION,
            True,
        ),
        (DocumentChanged, encoded({**CHANGED, "schema_version": 0}), PoisonCode.UNSUPPORTED_SCHEMA_VERSION, True),
        (
            DocumentChanged,
            encoded({"schema_version": 99, "shape": "new"}),
            PoisonCode.UNSUPPORTED_SCHEMA_VERSION,
            False,
        ),
        (DocumentChunked, encoded({**CHUNKED, "batch_count": 0}), PoisonCode.INVALID, True),
        (DocumentDeleted, encoded(CHANGED), PoisonCode.INVALID, True),
    ],
)
def test_a_poison_message_is_named_with_its_reason(
    expected: type[BaseModel], value: bytes | None, code: PoisonCode, has_header: bool
) -> None:
    poison = inspect(expected, ORIGIN, value)
    assert poison is not None
    assert poison.code is code, poison.reason
    assert poison.reason
    assert (poison.header == HEADER) if has_header else poison.header is None
    assert poison.retryable is (code is PoisonCode.UNSUPPORTED_SCHEMA_VERSION)
    assert poison.key == "doc-1"


@pytest.mark.parametrize(
    ("expected", "value"),
    [
        (DocumentChanged, encoded(CHANGED)),
        (DocumentChanged, encoded({key: value for key, value in CHANGED.items() if key != "schema_version"})),
        (DocumentChunked, encoded(CHUNKED)),
        (DocumentChanged, DocumentChanged(header=HEADER).model_dump_json().encode()),
    ],
)
def test_a_good_message_passes(expected: type[BaseModel], value: bytes) -> None:
    assert inspect(expected, ORIGIN, value) is None


def test_every_consumed_topic_is_guarded() -> None:
    assert set(CONSUMED) == {"doc.changed", "doc.deleted", "doc.chunked", "chunk.embedded"}


def test_a_dead_letter_without_a_document_round_trips_with_its_bytes() -> None:
    poison = inspect(DocumentChanged, ORIGIN, b"\xff\x00")
    assert poison is not None
    letter = DeadLetter(
        header=None,
        step="chunk",
        code=poison.code,
        message=poison.reason,
        retryable=False,
        retry_count=0,
        origin=poison.origin,
    )
    again = DeadLetter.model_validate_json(letter.model_dump_json())
    assert again.origin == ORIGIN
    assert again.header is None


class RecordingService:
    """Stands in for ``ServiceContext`` where no document is named: only ``publish`` is reached."""

    runtime = None

    def __init__(self) -> None:
        self.published: list[tuple[Topic, DeadLetter, str]] = []

    async def publish(self, topic: Topic, message: DeadLetter, key: str) -> None:
        self.published.append((topic, message, key))


async def test_the_guard_keeps_a_poison_message_from_its_handler_in_memory() -> None:
    """The middleware on FastStream's in-memory broker: the poison is dead-lettered and acked, the
    handler sees only the good message after it."""
    broker = KafkaBroker()
    broker.add_middleware(PoisonGuard)
    seen: list[DocumentChanged] = []

    @broker.subscriber(Topic.DOC_CHANGED.value, group_id="ragstream-chunker")
    async def doc_changed(message: DocumentChanged) -> None:
        seen.append(message)

    service = RecordingService()
    async with TestKafkaBroker(broker) as memory:
        memory.context.set_global("service", service)
        await memory.publish(b"\xff\xfe garbage", Topic.DOC_CHANGED.value, key=b"doc-9")
        await memory.publish(DocumentChanged(header=HEADER), Topic.DOC_CHANGED.value, key=b"doc-1")
    assert seen == [DocumentChanged(header=HEADER)]
    ((topic, letter, key),) = service.published
    assert (topic, letter.code, letter.step, letter.header, key) == (
        Topic.DEAD_LETTER,
        "undecodable_message",
        "chunk",
        None,
        "doc-9",
    )
    assert letter.origin is not None and letter.origin.payload == b"\xff\xfe garbage"
