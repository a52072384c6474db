"""The HTTP answer to each family of :mod:`ragstream.core.errors` that a route leaves unhandled."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ragstream.core.errors import Conflict, InvalidInput, NotFound, RagstreamError, Unavailable

__all__ = ["STATUS_BY_FAMILY", "error_response", "install_error_handlers"]

STATUS_BY_FAMILY: dict[type[RagstreamError], int] = {InvalidInput: 422, NotFound: 404, Conflict: 409, Unavailable: 503}
"""Only these families answer with their own status; any other error stays a 500."""


def error_response(error: RagstreamError) -> JSONResponse:
    """``{"detail": ...}`` with the family's status, as FastAPI's own errors. An :class:`Unavailable`
    error says only its ``public_reason`` (its message may name internals) and when to retry; the
    other families' messages are written for the caller."""
    status = next(status for family, status in STATUS_BY_FAMILY.items() if isinstance(error, family))
    if isinstance(error, Unavailable):
        return JSONResponse(
            status_code=status,
            content={"detail": error.public_reason},
            headers={"Retry-After": str(error.retry_after_s)},
        )
    return JSONResponse(status_code=status, content={"detail": str(error)})


def install_error_handlers(app: FastAPI) -> None:
    """Answer every family of :data:`STATUS_BY_FAMILY` with :func:`error_response`."""

    async def handle(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RagstreamError)  # registered for RagstreamError families only
        return error_response(error)

    for family in STATUS_BY_FAMILY:
        app.add_exception_handler(family, handle)
