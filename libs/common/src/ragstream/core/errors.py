"""ragstream's errors: one hierarchy, each error with a stable ``code`` and whether a retry may help.

``code`` and ``retryable`` are class attributes that an instance may override (an embedding
provider says per request whether to retry). Every family is named after what went wrong, so a
caller catches the family and maps it once (the HTTP API: :func:`ragstream.api.errors.error_response`)::

    RagstreamError          "error": anything ragstream raises on purpose
    ├── InvalidInput        "invalid_input": the caller's input is refused (HTTP 422)
    │     OutboundRefused, FolderNotAllowed
    ├── NotFound            "not_found": no such thing (HTTP 404)
    │     UnknownConnection
    ├── Conflict            "conflict": the thing is busy with other work, try once it is done (HTTP 409)
    │     RunInProgress, RagDisabled, ReindexBusy, RechunkBusy
    ├── Unavailable         "unavailable", retryable: cannot serve now (HTTP 503 with Retry-After)
    │     DatabaseBusy, DatabaseUnavailable, Overloaded
    ├── ConfigurationError  "configuration_error": the deployment's setup is missing or wrong
    │     CredentialKeyMissing, CredentialsUnreadable, AccessSetupError, NoConnector
    ├── ProviderError       "provider_error": a model service failed, retryable as it said
    │     EmbeddingError, ChatError (RephraseError), RerankError, ContextUnavailable
    ├── DocumentError       "document_error": one document cannot be indexed (a ``document_failures`` row)
    │     ParseError, DocumentUnreadable (codes of their own), DocumentVanished,
    │     StaleChunkingError, RetiredSpaceError (retryable), MissingContent, MixedEmbeddingModelsError
    ├── KnowledgeFailure    the knowledge tool's structured error (its ``ErrorCode``)
    └── EmbeddingDegraded   "embedding_degraded": too many chunks of a sync got no vector; the sync stops

An error that also is a built-in one keeps that base (``DatabaseBusy`` is a ``TimeoutError``,
``UnknownConnection`` a ``LookupError``), so code catching the built-in still catches it. The codes a
stage records for a document are chosen by ``ragstream.failures.classify``.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "Conflict",
    "DocumentError",
    "InvalidInput",
    "NotFound",
    "ProviderError",
    "RagstreamError",
    "Unavailable",
]


class RagstreamError(Exception):
    """The root of ragstream's errors; ``code`` and ``retryable`` default per class."""

    code: str = "error"
    retryable: bool = False

    def __init__(self, *args: object, code: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(*args)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class InvalidInput(RagstreamError):
    """The caller's input is refused; the message says why, never with a secret."""

    code = "invalid_input"


class NotFound(RagstreamError):
    """What the call names does not exist."""

    code = "not_found"


class Conflict(RagstreamError):
    """What the call names is busy with other work (a sync, a re-index, a re-chunk) or in the wrong state."""

    code = "conflict"


class Unavailable(RagstreamError):
    """The service cannot serve now; the same call may succeed after ``retry_after_s``.

    ``public_reason`` is what a caller is told: the message may name internals (a statement timeout).
    """

    code = "unavailable"
    retryable = True
    retry_after_s: int = 1
    public_reason: str = "the service is unavailable"


class ConfigurationError(RagstreamError):
    """The deployment is missing a setting or a key, or one is wrong: an operator has to act."""

    code = "configuration_error"


class ProviderError(RagstreamError):
    """A model service (embedding, chat, rerank) failed; ``retryable`` is what its answer implies."""

    code = "provider_error"


class DocumentError(RagstreamError):
    """One document cannot be indexed now; it is recorded failed while the rest goes on."""

    code = "document_error"
