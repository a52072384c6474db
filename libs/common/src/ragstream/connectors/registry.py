"""Builds the connector of a stored connection: the one place that maps a platform to its code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from ragstream.connectors.base import Connector
from ragstream.connectors.feishu import FeishuConnector
from ragstream.connectors.folder import FolderConnector, FolderNotAllowed, confined_folder, folder_connection_id
from ragstream.connectors.ima import ImaConnector
from ragstream.connectors.yuque import YuqueConnector
from ragstream.core.errors import ConfigurationError
from ragstream.settings import FolderSettings
from ragstream.storage.documents import DocumentStore

__all__ = ["INDEXABLE_PLATFORMS", "ConnectionRow", "NoConnector", "connector_for", "register_folder"]


class NoConnector(ConfigurationError):
    """The connection's platform has no connector in this build (or its config cannot make one)."""


@dataclass(frozen=True, slots=True)
class ConnectionRow:
    """The columns of ``connections`` a connector is built from. ``credentials`` are decrypted, each
    value a ``SecretStr`` (a repr or a log line shows ``'**********'``); empty for a folder."""

    id: str
    platform: str
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    credentials: Mapping[str, SecretStr] = field(default_factory=dict)


def _folder(row: ConnectionRow) -> Connector:
    path = row.config.get("path")
    if not isinstance(path, str):
        raise ValueError(f"folder connection {row.id} has no config.path")
    # A folder the operator registered (ingest, up --source) has the id derived from its resolved
    # path; any other folder, and one whose path now resolves elsewhere, must lie in a root.
    if row.id != folder_connection_id(Path(path)):
        try:
            confined_folder(path, FolderSettings().roots())
        except FolderNotAllowed as error:
            raise ValueError(f"folder connection {row.id}: {error}") from None
    # The stored config (chunking) is kept as it is: None means "do not replace it".
    return FolderConnector(Path(path), connection_id=row.id)


def _feishu(row: ConnectionRow) -> Connector:
    return FeishuConnector.from_connection(row.id, row.name, row.config, row.credentials, platform=row.platform)


def _yuque(row: ConnectionRow) -> Connector:
    return YuqueConnector.from_connection(row.id, row.name, row.config, row.credentials)


def _ima(row: ConnectionRow) -> Connector:
    return ImaConnector.from_connection(row.id, row.name, row.config, row.credentials)


#: Platform → the builder of its connector; a builder's ValueError names the missing or invalid
#: fields, never a secret's value.
_BUILDERS: dict[str, Callable[[ConnectionRow], Connector]] = {
    "folder": _folder,
    "feishu": _feishu,
    "lark": _feishu,
    "yuque": _yuque,
    "ima": _ima,
}

#: The platforms this build has a connector for, so that a RAG connection of them can be synced.
INDEXABLE_PLATFORMS = frozenset(_BUILDERS)


def connector_for(row: ConnectionRow) -> Connector:
    """The connector that syncs ``row``; raises ``NoConnector`` for platforms not built in."""
    build = _BUILDERS.get(row.platform)
    if build is None:
        raise NoConnector(f"no connector for platform {row.platform} in this build")
    try:
        return build(row)
    except ValueError as error:
        raise NoConnector(str(error)) from None


async def register_folder(store: DocumentStore, folder: Path, config: Mapping[str, Any] | None = None) -> str:
    """Register a local folder as a ``folder`` connection and return its id. The stored config gets the
    folder's path beside ``config`` (chunking), so a run can rebuild the connector from the row alone."""
    connector = FolderConnector(folder)
    stored = {**(config or {}), "path": str(connector.root)}
    await store.ensure_connection(connector.connection_id, connector.platform, connector.name, stored)
    return connector.connection_id
