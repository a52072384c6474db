"""Builds the live searcher of a stored connection: the one place that maps a platform to its search."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import SecretStr

from ragstream.direct.base import PlatformSearcher
from ragstream.direct.dingtalk import DingTalkSearcher
from ragstream.direct.feishu import FeishuSearcher
from ragstream.direct.ima import ImaSearcher
from ragstream.direct.yuque import YuqueSearcher
from ragstream.vendor_http import RetryPolicy

__all__ = ["DIRECT_PLATFORMS", "searcher_for"]

_Builder = Callable[..., PlatformSearcher]

_BUILDERS: dict[str, _Builder] = {
    "dingtalk": DingTalkSearcher.from_connection,
    "feishu": FeishuSearcher.from_connection,
    "lark": functools.partial(FeishuSearcher.from_connection, platform="lark"),
    "yuque": YuqueSearcher.from_connection,
    "ima": ImaSearcher.from_connection,
}

#: The platforms a connection with RAG off is searched live on.
DIRECT_PLATFORMS = frozenset(_BUILDERS)


def searcher_for(
    platform: str,
    connection_id: str,
    name: str,
    config: Mapping[str, Any],
    credentials: Mapping[str, SecretStr],
    *,
    timeout_s: float,
    retry: RetryPolicy,
) -> PlatformSearcher:
    """The searcher of a connection of ``platform`` (one of ``DIRECT_PLATFORMS``); ``ValueError``
    names what its config or credentials lack."""
    build = _BUILDERS[platform]
    return build(connection_id, name, config, credentials, timeout_s=timeout_s, retry=retry)
