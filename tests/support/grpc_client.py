"""What the gRPC tests share: a search result message as the HTTP API's JSON has it."""

from __future__ import annotations

from typing import Any

from ragstream.v1 import retrieval_pb2

__all__ = ["result_dict"]


def result_dict(result: retrieval_pb2.SearchResult) -> dict[str, Any]:
    """Every field of ``result`` by name; an unset optional field is ``None`` (null in JSON)."""
    return {
        name: getattr(result, name) if not field.has_presence or result.HasField(name) else None
        for name, field in result.DESCRIPTOR.fields_by_name.items()
    }
