"""Builds a connection's platform operations: the one place that maps a platform to its adapter."""

from __future__ import annotations

from collections.abc import Callable

from ragstream.knowledge.dingtalk import DingTalkOperations
from ragstream.knowledge.ima import ImaOperations
from ragstream.knowledge.platforms import PlatformOperations
from ragstream.knowledge.yuque import YuqueOperations
from ragstream.storage.knowledge import KnowledgeConnection
from ragstream.vendor_http import RetryPolicy

__all__ = ["operations_for"]

_BUILDERS: dict[str, Callable[..., PlatformOperations]] = {
    "yuque": YuqueOperations.from_connection,
    "ima": ImaOperations.from_connection,
    "dingtalk": DingTalkOperations.from_connection,
}


def operations_for(connection: KnowledgeConnection, *, timeout_s: float, retry: RetryPolicy) -> PlatformOperations:
    """The operations of ``connection`` on its platform (those without an adapter refuse every one);
    ``ValueError`` names what its config or credentials lack."""
    build = _BUILDERS.get(connection.platform)
    if build is None:
        operations = PlatformOperations()
        operations.platform = connection.platform
        return operations
    return build(connection, timeout_s=timeout_s, retry=retry)
