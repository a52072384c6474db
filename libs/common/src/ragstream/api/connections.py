"""``/v1/connections``: create, list, read, change and delete connections; credentials go in, never out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Response
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, ValidationError, model_validator

from ragstream import outbound
from ragstream.api.syncs import SyncError
from ragstream.chunking import ChunkingConfig, parse_chunking
from ragstream.connectors.folder import FolderNotAllowed, confined_folder
from ragstream.connectors.registry import INDEXABLE_PLATFORMS
from ragstream.core.storable import Storable
from ragstream.credentials import CredentialKeyMissing
from ragstream.embedding.config import EmbedderConfig, stored_embedder
from ragstream.metrics import CONNECTION_CHANGES
from ragstream.reindex import UnknownConnection
from ragstream.settings import FolderSettings
from ragstream.storage.connections import Connection, ConnectionStore, PinnedModel

__all__ = [
    "ConnectionConfig",
    "ConnectionCreate",
    "ConnectionHook",
    "ConnectionPatch",
    "ConnectionView",
    "EmbeddingHook",
    "EmbeddingResolver",
    "RechunkHook",
    "connections_router",
]

logger = logging.getLogger(__name__)

Platform = Literal["folder", "feishu", "lark", "yuque", "ima", "dingtalk", "web"]
ConnectionStatus = Literal["active", "disabled", "archived"]
CredentialName = Annotated[str, StringConstraints(min_length=1, max_length=100)]
Credentials = dict[CredentialName, SecretStr]

ConnectionHook = Callable[[str], Awaitable[None]]
"""Called with a connection id after the change is committed, e.g. to start a sync."""

RechunkHook = Callable[[str, ChunkingConfig], Awaitable[None]]
"""Queues a re-chunk run of a connection with a new chunking config (``api.rechunk.connection_rechunk``)."""

EmbeddingHook = Callable[[str, dict[str, Any] | None], Awaitable[None]]
"""Queues a re-index run of a connection into a model's space (``api.reindex.connection_reindex``; ``None``: the
default's)."""

EmbeddingResolver = Callable[[dict[str, Any]], Awaitable[tuple[str, int]]]
"""The model key and dimension of the embedder a spec builds (``ActiveSpace.resolve``); ``ValueError``."""

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No connection with this id"}}

#: Config keys that decide where a connector sends the connection's credentials.
_DESTINATION_KEYS = ("base_url",)


def _rag_refusal(platform: str) -> str | None:
    """Why a connection of ``platform`` cannot have RAG on, or None when it can."""
    if platform in INDEXABLE_PLATFORMS:
        return None
    if platform == "dingtalk":
        return (
            "dingtalk connections cannot have rag_enabled: DingTalk has no API that returns a document's full "
            "text to index, so they serve direct search only; create it with rag_enabled false"
        )
    return f"platform {platform} has no connector in this build to index it; create it with rag_enabled false"


class ConnectionConfig(BaseModel):
    """Platform settings. Keys besides these (space or knowledge-base ids, base URLs) are kept as given;
    secrets belong in ``credentials``, which are encrypted, not here, where they would be shown."""

    model_config = ConfigDict(extra="allow", title="Connection config")

    path: Annotated[
        str | None,
        Field(
            title="Folder path",
            description="folder: an absolute path to a directory inside one of the server's RAGSTREAM_FOLDER_ROOTS.",
        ),
    ] = None
    chunking: Annotated[
        ChunkingConfig | None,
        Field(
            title="Chunking",
            description="Unset: the server's. Changing it re-chunks the indexed documents in the background "
            "(progress: GET /v1/connections/{id}/rechunk) while search uses the current chunks; the new "
            "value shows here once switched in.",
        ),
    ] = None
    embedding: Annotated[
        EmbedderConfig | None,
        Field(
            title="Embedding model",
            description="Unset: the server's default (a deployment-wide re-index moves it). Set: this connection's "
            "own model, from its first sync on. Changing it (null: back to the default) re-embeds the indexed "
            "chunks in the background (progress: GET /v1/connections/{id}/reindex) while search uses the current "
            "vectors; the new value shows here once switched in.",
        ),
    ] = None

    def stored(self) -> dict[str, Any]:
        """The keys that were given, as JSON for the ``config`` column."""
        return self.model_dump(mode="json", exclude_none=True)


class ConnectionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", title="New connection")

    platform: Annotated[Platform, Field(title="Platform")]
    name: Annotated[str, Field(title="Display name", min_length=1, max_length=200), Storable]
    config: Annotated[ConnectionConfig, Field(title="Platform settings")] = ConnectionConfig()
    credentials: Annotated[
        Credentials | None,
        Field(
            title="Credentials",
            description="Field name to secret (app_id, app_secret, token, ...). Stored encrypted; responses "
            "show the field names only.",
        ),
    ] = None
    rag_enabled: Annotated[
        bool, Field(title="RAG indexing", description="On: a local index, built by a full sync after creation.")
    ] = True
    schedule_seconds: Annotated[
        int, Field(title="Seconds between scheduled syncs", description="0: only on request.", ge=0)
    ] = 86_400
    skip_acl: Annotated[
        bool,
        Field(title="Skip per-user permission checks", description="Fixed at creation: it cannot be changed later."),
    ] = False

    @model_validator(mode="after")
    def _folder_has_a_path(self) -> ConnectionCreate:
        if self.platform == "folder" and self.config.path is None:
            raise ValueError("a folder connection needs config.path, a directory inside RAGSTREAM_FOLDER_ROOTS")
        return self

    @model_validator(mode="after")
    def _rag_needs_a_connector(self) -> ConnectionCreate:
        if self.rag_enabled and (refusal := _rag_refusal(self.platform)):
            raise ValueError(refusal)
        return self


class ConnectionPatch(BaseModel):
    """Fields to change; omitted or null fields keep their value."""

    model_config = ConfigDict(extra="forbid", title="Connection change")

    name: Annotated[str | None, Field(title="Display name", min_length=1, max_length=200), Storable] = None
    config: Annotated[
        ConnectionConfig | None, Field(title="Platform settings", description="Replaces the top-level keys given.")
    ] = None
    credentials: Annotated[
        Credentials | None, Field(title="Credentials", description="Replaces all of them; {} removes them.")
    ] = None
    rag_enabled: Annotated[
        bool | None,
        Field(
            title="RAG indexing",
            description="Off removes the indexed documents and keeps the connection; on again runs a full sync.",
        ),
    ] = None
    schedule_seconds: Annotated[int | None, Field(title="Seconds between scheduled syncs", ge=0)] = None
    status: Annotated[
        ConnectionStatus | None, Field(title="Status", description="Disabled and archived ones are not searched.")
    ] = None

    @model_validator(mode="before")
    @classmethod
    def _skip_acl_is_fixed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "skip_acl" in data:
            raise ValueError("skip_acl is fixed when a connection is created; create a new connection to change it")
        return data


class ConnectionView(BaseModel):
    """A connection as the API shows it: credential field names, never their values."""

    model_config = ConfigDict(title="Connection")

    id: Annotated[str, Field(title="Connection id")]
    # str, not Platform: connections made by folder syncs and services are listed too, whatever they name.
    platform: Annotated[str, Field(title="Platform", description="folder, feishu, lark, yuque, ima, dingtalk, web")]
    name: Annotated[str, Field(title="Display name")]
    config: Annotated[dict[str, Any], Field(title="Platform settings")]
    status: Annotated[ConnectionStatus, Field(title="Status")]
    skip_acl: Annotated[bool, Field(title="Skip per-user permission checks")]
    rag_enabled: Annotated[bool, Field(title="RAG indexing")]
    schedule_seconds: Annotated[int, Field(title="Seconds between scheduled syncs")]
    has_credentials: Annotated[bool, Field(title="Credentials are stored")]
    credential_fields: Annotated[
        list[str], Field(title="Names of the stored credential fields", description="Empty if unreadable.")
    ]
    sync_error: SyncError
    created_at: Annotated[datetime, Field(title="Created")]
    updated_at: Annotated[datetime, Field(title="Last changed")]

    @classmethod
    def of(cls, connection: Connection) -> ConnectionView:
        return cls.model_validate(asdict(connection))


def connections_router(
    store: ConnectionStore,
    *,
    on_created: ConnectionHook | None = None,
    on_rag_enabled: ConnectionHook | None = None,
    on_chunking_changed: RechunkHook | None = None,
    on_embedding_changed: EmbeddingHook | None = None,
    resolve_embedding: EmbeddingResolver | None = None,
    folder_roots: Sequence[Path] | None = None,
    allow_private_networks: bool | None = None,
    tracer: trace.Tracer | None = None,
) -> APIRouter:
    """The routes. ``on_created`` runs after a connection with RAG on is created, ``on_rag_enabled`` after
    an update turns RAG on again: both are where the caller starts the full sync. A failing hook is
    logged and does not undo the change, which is committed and reported as done.

    With ``on_chunking_changed``, an update that changes the chunking config does not store it: the
    hook starts a re-chunk, which stores it when it switches the rebuilt chunks in (before the rest of
    the update, so that a re-chunk already running answers 409 and changes nothing). Without it, a
    new config applies to documents chunked from then on.

    The embedding model likewise: with ``resolve_embedding``, a connection created with one is pinned
    to its space at once; with ``on_embedding_changed``, an update that changes it starts the
    connection's re-index, which stores it when it switches. Without them it is only stored.

    What a connection may reach is checked before anything is stored (422 otherwise): a folder's
    ``config.path`` must resolve inside ``folder_roots`` (None: RAGSTREAM_FOLDER_ROOTS), and every
    vendor URL (``config.base_url``, ``config.embedding.base_url``) must pass ``ragstream.outbound``
    (``allow_private_networks`` None: RAGSTREAM_ALLOW_PRIVATE_NETWORKS). Changing ``base_url`` of a
    connection with stored credentials needs the credentials again in the same request, so that a
    changed URL never receives secrets given for another host."""
    router = APIRouter(prefix="/v1/connections", tags=["connections"])
    spans = tracer or trace.get_tracer(__name__)
    roots = list(folder_roots) if folder_roots is not None else FolderSettings().roots()

    def unprocessable(detail: str) -> HTTPException:
        return HTTPException(status_code=422, detail=detail)

    def confined(path: str) -> str:
        try:
            return str(confined_folder(path, roots))
        except FolderNotAllowed as error:
            raise unprocessable(str(error)) from None

    async def check_destinations(config: ConnectionConfig) -> None:
        urls = {key: config.stored().get(key) for key in _DESTINATION_KEYS}
        if config.embedding is not None:
            urls["embedding.base_url"] = config.embedding.spec().get("base_url")
        for key, url in urls.items():
            if url is None:
                continue
            if not isinstance(url, str):
                raise unprocessable(f"config.{key} must be a URL string")
            try:
                await asyncio.to_thread(outbound.check_url, url, allow_private=allow_private_networks)
            except outbound.OutboundRefused as error:
                raise unprocessable(f"config.{key}: {error}") from None

    def require_credentials_for(current: Connection, body: ConnectionPatch, config: dict[str, Any]) -> None:
        moved = [key for key in _DESTINATION_KEYS if key in config and config[key] != current.config.get(key)]
        if moved and current.has_credentials and body.credentials is None:
            raise unprocessable(
                f"changing config.{moved[0]} of a connection with stored credentials needs the credentials again "
                "in the same request: they are never sent to a new host without being given for it"
            )

    async def run_hook(hook: ConnectionHook | None, connection_id: str) -> None:
        if hook is None:
            return
        try:
            await hook(connection_id)
        except Exception:
            logger.exception("connection %s: starting its sync failed", connection_id)

    def stored_chunking(connection: Connection) -> ChunkingConfig | None:
        try:
            return parse_chunking(connection.config["chunking"]) if "chunking" in connection.config else None
        except ValidationError:  # unreadable: any valid config given is a change
            return None

    def same_embedding(connection: Connection, given: EmbedderConfig | None) -> bool:
        """Whether ``given`` is the connection's model as stored; an unreadable stored one never is."""
        stored = connection.config.get("embedding")
        if stored is None or given is None:
            return stored is None and given is None
        try:
            return isinstance(stored, dict) and stored_embedder(stored) == given
        except ValueError:
            return False

    def not_found(connection_id: str) -> HTTPException:
        return HTTPException(status_code=404, detail=f"connection {connection_id!r} not found")

    async def pinned_model(config: ConnectionConfig) -> PinnedModel | None:
        if config.embedding is None or resolve_embedding is None:
            return None
        spec = config.embedding.spec()
        try:
            model_key, dimension = await resolve_embedding(spec)
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from None
        return PinnedModel(model_key, dimension, spec)

    async def change_embedding(connection_id: str, current: Connection, config: ConnectionConfig) -> None:
        """Start the re-index when the embedding model given differs from the connection's."""
        assert on_embedding_changed is not None
        if same_embedding(current, config.embedding):
            return
        try:  # a re-index already queued or running (RunInProgress) is a Conflict: 409, see ragstream.api.errors
            await on_embedding_changed(connection_id, config.embedding.spec() if config.embedding else None)
        except UnknownConnection:
            raise not_found(connection_id) from None
        except ValueError as error:
            raise HTTPException(status_code=422, detail=str(error)) from None
        logger.info("connection %s: re-indexing to another embedding model started", connection_id)

    @router.post("", status_code=201, response_model=ConnectionView)
    async def create_connection(body: ConnectionCreate) -> ConnectionView:
        """Create a connection; with RAG on, a full sync starts."""
        with spans.start_as_current_span("connections.create") as span:
            span.set_attribute("connection.platform", body.platform)
            config = body.config.stored()
            if body.platform == "folder" and body.config.path is not None:
                config["path"] = confined(body.config.path)
            await check_destinations(body.config)
            try:
                connection = await store.create(
                    body.platform,
                    body.name,
                    config=config,
                    credentials=body.credentials,
                    rag_enabled=body.rag_enabled,
                    schedule_seconds=body.schedule_seconds,
                    skip_acl=body.skip_acl,
                    embedding=await pinned_model(body.config),
                )
            except CredentialKeyMissing as error:
                raise HTTPException(status_code=422, detail=str(error)) from None
            span.set_attribute("connection.id", connection.id)
        CONNECTION_CHANGES.labels("create").inc()
        logger.info(
            "connection %s created (%s, credential fields %s)",
            connection.id,
            connection.platform,
            list(connection.credential_fields),
        )
        if connection.rag_enabled:
            await run_hook(on_created, connection.id)
        return ConnectionView.of(connection)

    @router.get("", response_model=list[ConnectionView])
    async def list_connections() -> list[ConnectionView]:
        """Every connection, oldest first."""
        with spans.start_as_current_span("connections.list"):
            return [ConnectionView.of(connection) for connection in await store.all()]

    @router.get("/{connection_id}", response_model=ConnectionView, responses=_NOT_FOUND)
    async def get_connection(connection_id: str) -> ConnectionView:
        with spans.start_as_current_span("connections.get") as span:
            span.set_attribute("connection.id", connection_id)
            connection = await store.get(connection_id)
        if connection is None:
            raise not_found(connection_id)
        return ConnectionView.of(connection)

    @router.patch("/{connection_id}", response_model=ConnectionView, responses=_NOT_FOUND)
    async def update_connection(connection_id: str, body: ConnectionPatch) -> ConnectionView:
        """Change a connection. RAG off removes its indexed documents at once; RAG on again starts a full sync."""
        with spans.start_as_current_span("connections.update") as span:
            span.set_attribute("connection.id", connection_id)
            span.set_attribute("connection.fields", sorted(body.model_fields_set))
            if body.rag_enabled:
                current = await store.get(connection_id)
                if current is None:
                    raise not_found(connection_id)
                if refusal := _rag_refusal(current.platform):
                    raise HTTPException(status_code=422, detail=refusal)
            config = body.config.stored() if body.config is not None else None
            if body.config is not None and config is not None:
                current = await store.get(connection_id)
                if current is None:
                    raise not_found(connection_id)
                if current.platform == "folder" and body.config.path is not None:
                    config["path"] = confined(body.config.path)
                await check_destinations(body.config)
                require_credentials_for(current, body, config)
            chunking = body.config.chunking if body.config is not None else None
            embedding_given = body.config is not None and "embedding" in body.config.model_fields_set
            if body.config is not None and config is not None and embedding_given and on_embedding_changed:
                current = await store.get(connection_id)
                if current is None:
                    raise not_found(connection_id)
                config.pop("embedding", None)
                await change_embedding(connection_id, current, body.config)
            if config is not None and chunking is not None and on_chunking_changed is not None:
                current = await store.get(connection_id)
                if current is None:
                    raise not_found(connection_id)
                config.pop("chunking")
                if stored_chunking(current) != chunking:
                    # A re-chunk already running (RechunkBusy) is a Conflict: 409, see ragstream.api.errors.
                    await on_chunking_changed(connection_id, chunking)
                    logger.info("connection %s: re-chunking started", connection_id)
            try:
                switch = await store.update(
                    connection_id,
                    name=body.name,
                    config=config or None,
                    credentials=body.credentials,
                    rag_enabled=body.rag_enabled,
                    schedule_seconds=body.schedule_seconds,
                    status=body.status,
                )
            except CredentialKeyMissing as error:
                raise HTTPException(status_code=422, detail=str(error)) from None
        if switch is None:
            raise not_found(connection_id)
        CONNECTION_CHANGES.labels("update").inc()
        logger.info("connection %s updated (%s)", connection_id, ", ".join(sorted(body.model_fields_set)))
        if switch.rag_turned_on:
            await run_hook(on_rag_enabled, connection_id)
        return ConnectionView.of(switch.connection)

    @router.delete("/{connection_id}", status_code=204, response_class=Response, responses=_NOT_FOUND)
    async def delete_connection(connection_id: str) -> Response:
        """Delete a connection and everything it indexed."""
        with spans.start_as_current_span("connections.delete") as span:
            span.set_attribute("connection.id", connection_id)
            deleted = await store.delete(connection_id)
        if not deleted:
            raise not_found(connection_id)
        CONNECTION_CHANGES.labels("delete").inc()
        logger.info("connection %s deleted with everything it indexed", connection_id)
        return Response(status_code=204)

    return router
