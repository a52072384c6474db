"""OpenTelemetry tracing: one provider per service, exported over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.

The Kafka middleware (``ragstream.kafka``) records a span per consumed and published message; the
:class:`TracingMiddleware` records a server span per HTTP request, continuing the caller's W3C
``traceparent``. Without an endpoint the spans are still made (the trace context still travels in
message headers) but go nowhere. The exporter reads the standard variables itself
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``..._TRACES_ENDPOINT``, ``..._HEADERS``, ``OTEL_BSP_*``), and the
SDK flushes the batch at process exit.
"""

from __future__ import annotations

import os

from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["TracingMiddleware", "exporting", "tracer_provider"]

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# One provider per service name; the first one made in a process is the global one.
_providers: dict[str, TracerProvider] = {}


def exporting() -> bool:
    """Whether spans leave the process (an OTLP endpoint is configured)."""
    return any(os.environ.get(name) for name in _ENDPOINT_VARIABLES)


def tracer_provider(service: str) -> TracerProvider:
    """The provider of ``ragstream-<service>``, made on first use with an OTLP exporter when
    :func:`exporting`, and installed as the global provider if none is yet."""
    if (provider := _providers.get(service)) is not None:
        return provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"ragstream-{service}"}))
    if exporting():
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if not _providers:
        trace.set_tracer_provider(provider)
    _providers[service] = provider
    return provider


class TracingMiddleware:
    """ASGI middleware: one server span per HTTP request, named by method and route template."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._tracer = trace.get_tracer("ragstream.http")  # follows the global provider, even one set later

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", [])}
        method = scope.get("method", "")
        with self._tracer.start_as_current_span(
            f"{method} {scope.get('path', '')}",
            context=propagate.extract(carrier),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope.get("path", "")},
        ) as span:

            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", int(message["status"]))
                await send(message)

            try:
                await self.app(scope, receive, sending)
            finally:
                # Known only once routing ran: the template keeps ids out of the span name.
                if (route := getattr(scope.get("route"), "path", None)) is not None:
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
