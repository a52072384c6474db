"""One error hierarchy: each project error in its family, with its code and retryability, and the HTTP
status its family maps to."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from fastapi import APIRouter

from ragstream.admission import Overloaded
from ragstream.api.http import create_app
from ragstream.chat import ChatError
from ragstream.connectors.base import DocumentUnreadable, DocumentVanished
from ragstream.connectors.folder import FolderNotAllowed
from ragstream.connectors.registry import NoConnector
from ragstream.contextual import ContextUnavailable
from ragstream.core.errors import (
    ConfigurationError,
    Conflict,
    DocumentError,
    InvalidInput,
    NotFound,
    ProviderError,
    RagstreamError,
    Unavailable,
)
from ragstream.credentials import CredentialKeyMissing, CredentialsUnreadable
from ragstream.embedding.base import EmbeddingError
from ragstream.failures import is_transient
from ragstream.outbound import OutboundRefused
from ragstream.parsing import ParseError, ParseErrorCode
from ragstream.rechunk import MissingContent
from ragstream.retrieval.rerank import RerankError
from ragstream.storage.database import DatabaseBusy, DatabaseUnavailable
from ragstream.storage.documents import StaleChunkingError
from ragstream.storage.rechunk import RechunkBusy
from ragstream.storage.runs import RagDisabled, RunInProgress
from ragstream.storage.spaces import ReindexBusy, RetiredSpaceError, UnknownConnection


@pytest.mark.parametrize(
    ("error", "family", "code", "retryable"),
    [
        (OutboundRefused("private address"), InvalidInput, "invalid_input", False),
        (FolderNotAllowed("outside the roots"), InvalidInput, "invalid_input", False),
        (UnknownConnection("k1"), NotFound, "not_found", False),
        (RunInProgress("sync", None), Conflict, "conflict", False),
        (RagDisabled("k1"), Conflict, "conflict", False),
        (ReindexBusy("busy"), Conflict, "conflict", False),
        (RechunkBusy("busy"), Conflict, "conflict", False),
        (DatabaseBusy("pool"), Unavailable, "database_busy", True),
        (DatabaseUnavailable("restarting"), Unavailable, "database_unavailable", True),
        (Overloaded("16 waiting", 2), Unavailable, "overloaded", True),
        (CredentialKeyMissing(), ConfigurationError, "configuration_error", False),
        (CredentialsUnreadable("altered"), ConfigurationError, "configuration_error", False),
        (NoConnector("web"), ConfigurationError, "configuration_error", False),
        (EmbeddingError("throttled", retryable=True, provider="dashscope"), ProviderError, "provider_error", True),
        (EmbeddingError("too long", retryable=False, provider="dashscope"), ProviderError, "provider_error", False),
        (ChatError("down", retryable=True), ProviderError, "provider_error", True),
        (RerankError("bad answer", retryable=False), ProviderError, "provider_error", False),
        (ContextUnavailable("down", retryable=True), ProviderError, "provider_error", True),
        (ParseError(ParseErrorCode.PARSE_TIMEOUT, "60 s"), DocumentError, "parse_timeout", False),
        (
            DocumentUnreadable("permission_denied", "no access", retryable=True),
            DocumentError,
            "permission_denied",
            True,
        ),
        (DocumentVanished("gone"), DocumentError, "document_error", False),
        (StaleChunkingError("d1", 1, 2), DocumentError, "document_error", True),
        (RetiredSpaceError("m1"), DocumentError, "document_error", True),
        (MissingContent("no staging"), DocumentError, "document_error", False),
    ],
)
def test_each_error_has_its_family_code_and_retryability(
    error: RagstreamError, family: type[RagstreamError], code: str, retryable: bool
) -> None:
    assert isinstance(error, family)
    assert (error.code, error.retryable) == (code, retryable)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (DatabaseBusy("pool"), TimeoutError),
        (DatabaseUnavailable("restarting"), ConnectionError),
        (UnknownConnection("k1"), LookupError),
        (OutboundRefused("private address"), ValueError),
        (CredentialKeyMissing(), RuntimeError),
    ],
)
def test_an_error_keeps_its_builtin_base(error: RagstreamError, builtin: type[Exception]) -> None:
    assert isinstance(error, builtin)


def test_code_and_retryable_can_be_set_per_instance() -> None:
    default, chosen = RagstreamError("plain"), RagstreamError("chosen", code="chosen_code", retryable=True)
    assert (default.code, default.retryable) == ("error", False)
    assert (chosen.code, chosen.retryable) == ("chosen_code", True)
    assert str(chosen) == "chosen"


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ChatError("throttled", retryable=True), True),
        (RerankError("rejected", retryable=False), False),
        (DocumentUnreadable("permission_denied", "no access", retryable=True), False),
    ],
)
def test_a_stage_retries_a_provider_error_as_the_provider_said(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


def _raising(error: Callable[[], Exception]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/boom")
    async def boom() -> None:
        raise error()

    return router


async def _not_ready() -> bool:
    return False


@pytest.mark.parametrize(
    ("error", "status", "body", "retry_after"),
    [
        (lambda: OutboundRefused("config.url: a private address"), 422, "config.url: a private address", None),
        (lambda: UnknownConnection("connection 'k1' not found"), 404, "connection 'k1' not found", None),
        (lambda: RunInProgress("sync", None), 409, "Sync already in progress", None),
        (lambda: DatabaseBusy("canceling statement due to statement timeout"), 503, "the database is busy", "1"),
        (lambda: DatabaseUnavailable("postmaster.pid is stale"), 503, "the database is unavailable", "1"),
        (lambda: Overloaded("16 waiting", 3), 503, "too many searches at once", "3"),
    ],
)
async def test_the_api_answers_an_unhandled_error_with_its_familys_status(
    error: Callable[[], Exception], status: int, body: str, retry_after: str | None
) -> None:
    app = create_app(None, ready=_not_ready, routers=[_raising(error)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.get("/v1/boom")
    assert (response.status_code, response.json(), response.headers.get("retry-after")) == (
        status,
        {"detail": body},
        retry_after,
    )


async def test_an_error_of_no_mapped_family_stays_a_server_error() -> None:
    app = create_app(None, ready=_not_ready, routers=[_raising(CredentialKeyMissing)])
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/v1/boom")
    assert response.status_code == 500
