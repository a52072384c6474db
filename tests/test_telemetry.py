"""Spans leave every kind of process over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set: a local receiver
on loopback decodes what the retriever (HTTP), a Kafka stage (consumed messages) and ``ragstream up`` send."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from fastapi import FastAPI, Request, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ragstream.messages import DocumentChanged, DocumentHeader
from tests.support.connections import private_database
from tests.support.http_server import serve_in_thread
from tests.support.services import ServiceProcess


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    attributes: dict[str, str]


class OtlpReceiver:
    """The OTLP/HTTP trace endpoint of a collector (protobuf bodies on ``POST /v1/traces``)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.app = FastAPI()
        self.app.add_api_route("/v1/traces", self.receive, methods=["POST"])

    async def receive(self, request: Request) -> Response:
        assert request.headers["content-type"] == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.body())
        for resource_spans in export.resource_spans:
            resource = {item.key: item.value.string_value for item in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {item.key: str(item.value.string_value) for item in span.attributes}
                    received = ReceivedSpan(
                        resource.get("service.name", ""), span.name, span.trace_id.hex(), attributes
                    )
                    with self._lock:
                        self.spans.append(received)
        return Response(ExportTraceServiceRequest().SerializeToString(), media_type="application/x-protobuf")

    def wait_for(self, matches: Callable[[ReceivedSpan], bool], what: str, timeout: float = 60) -> ReceivedSpan:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [span for span in self.spans if matches(span)]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no span {what}; received {[(s.service, s.name) for s in self.spans]}")


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[OtlpReceiver, str]]:
    otlp = OtlpReceiver()
    with serve_in_thread(otlp.app, "otlp-receiver") as url:
        yield otlp, url


def exporting_env(url: str) -> dict[str, str]:
    # A short batch delay: spans arrive within a fraction of a second, not the default 5 s.
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.mark.integration
def test_the_retriever_exports_a_server_span_per_request_in_the_callers_trace(
    receiver: tuple[OtlpReceiver, str], database_url: str, tmp_path: Path
) -> None:
    otlp, url = receiver
    env = {"DATABASE_URL": database_url, **exporting_env(url)}
    retriever = ServiceProcess("retriever", env, tmp_path).start(timeout=120)
    try:
        trace_id = uuid.uuid4().hex
        traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
        response = httpx.post(
            f"{retriever.url}/v1/search", json={"query": "vpn"}, headers={"traceparent": traceparent}, timeout=30
        )
        assert response.status_code == 200, response.text
        span = otlp.wait_for(
            lambda span: span.service == "ragstream-retriever" and span.name == "POST /v1/search",
            "of the search",
        )
        assert span.trace_id == trace_id  # the caller's trace continues
        assert span.attributes["http.route"] == "/v1/search"
    finally:
        retriever.stop()


@pytest.mark.integration
@pytest.mark.kafka
async def test_a_kafka_stage_exports_a_span_per_consumed_message(
    receiver: tuple[OtlpReceiver, str], database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    otlp, url = receiver
    async with private_database(database_url) as dsn:
        env = {"DATABASE_URL": dsn, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, **exporting_env(url)}
        env["RAGSTREAM_KAFKA_SESSION_TIMEOUT_MS"] = "6000"
        chunker = ServiceProcess("chunker", env, tmp_path)
        await asyncio.to_thread(chunker.start, 120)
        try:
            document_id = uuid.uuid4().hex
            header = DocumentHeader(
                document_id=document_id,
                connection_id="telemetry",
                external_id="a.md",
                version=1,
                content_hash="0" * 64,
                title="A",
                source="a.md",
                media_type="text/markdown",
            )
            producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
            await producer.start()
            try:
                message = DocumentChanged(header=header).model_dump_json().encode()
                await producer.send_and_wait("doc.changed", message, key=document_id.encode())
            finally:
                await producer.stop()
            span = await asyncio.to_thread(
                otlp.wait_for,
                lambda span: span.service == "ragstream-chunker" and "doc.changed" in span.name,
                "of the consumed doc.changed",
                120,
            )
            assert span.attributes.get("messaging.system") == "kafka"
        finally:
            await asyncio.to_thread(chunker.stop)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.integration
async def test_ragstream_up_exports_spans(
    receiver: tuple[OtlpReceiver, str], database_url: str, tmp_path: Path
) -> None:
    otlp, url = receiver
    port = _free_port()
    async with private_database(database_url) as dsn:
        env = {**os.environ, "DATABASE_URL": dsn, "RAGSTREAM_DATA_DIR": str(tmp_path), **exporting_env(url)}
        env.pop("RAGSTREAM_API_KEYS", None)
        command = [str(Path(sys.executable).with_name("ragstream")), "up", "--port", str(port), "--grpc-port", "0"]
        with (tmp_path / "up.log").open("wb") as log:
            process = await asyncio.to_thread(subprocess.Popen, command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:

            def healthy() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            deadline = time.monotonic() + 120
            while not await asyncio.to_thread(healthy):
                assert process.poll() is None, (tmp_path / "up.log").read_text()
                assert time.monotonic() < deadline, "ragstream up did not serve within 120 s"
                await asyncio.sleep(0.3)
            span = await asyncio.to_thread(
                otlp.wait_for, lambda span: span.service == "ragstream-up" and span.name == "GET /healthz", "of up"
            )
            assert span.attributes["http.route"] == "/healthz"
        finally:
            process.terminate()
            process.wait(60)
