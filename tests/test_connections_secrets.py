"""A planted credential must never come out: not in responses, logs, metrics, spans or the database column."""

from __future__ import annotations

import base64
import json
import logging
import uuid

import httpx
import pytest
from cryptography.fernet import Fernet
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from pydantic import SecretStr

from ragstream.api.connections import connections_router
from ragstream.api.http import create_app
from ragstream.credentials import CredentialCipher
from ragstream.runtime import Runtime
from ragstream.storage.connections import ConnectionStore

pytestmark = pytest.mark.integration


async def ready() -> bool:
    return True


async def failing_sync(connection_id: str) -> None:
    raise RuntimeError(f"sync of {connection_id} could not start")


def encodings(secret: str) -> list[bytes]:
    """The secret and the base64 forms a careless encoder would produce."""
    raw = secret.encode()
    return [raw, base64.b64encode(raw), base64.urlsafe_b64encode(raw).rstrip(b"=")]


async def test_a_planted_credential_appears_nowhere(runtime: Runtime, caplog: pytest.LogCaptureFixture) -> None:
    secret = "sk-PLANTED-" + uuid.uuid4().hex
    replaced = "sk-PLANTED-" + uuid.uuid4().hex
    caplog.set_level(logging.DEBUG)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    store = ConnectionStore(runtime.pool, CredentialCipher([SecretStr(Fernet.generate_key().decode())]))
    router = connections_router(
        store, on_created=failing_sync, on_rag_enabled=failing_sync, tracer=provider.get_tracer("t")
    )
    app = create_app(lambda: runtime.retriever, ready=ready, routers=[router])
    responses: list[httpx.Response] = []

    async def keep(response: httpx.Response) -> None:
        await response.aread()
        responses.append(response)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", event_hooks={"response": [keep]}
    ) as client:
        body = {"platform": "feishu", "name": "wiki", "credentials": {"app_id": "cli_1", "app_secret": secret}}
        created = await client.post("/v1/connections", json=body)
        assert created.status_code == 201
        cid = created.json()["id"]
        url = f"/v1/connections/{cid}"

        bad_bodies = [
            {"platform": "feishu", "credentials": {"app_secret": secret}},  # no name: the whole body is the input
            {"platform": "folder", "name": "f", "credentials": {"app_secret": secret}},
            {"platform": "feishu", "name": "x", "credentials": {"app_secret": [secret]}},
            {"platform": "gitlab", "name": "x", "credentials": {"app_secret": secret}},
        ]
        for bad in bad_bodies:
            assert (await client.post("/v1/connections", json=bad)).status_code == 422
        bad_patches = [
            {"skip_acl": True, "credentials": {"app_secret": secret}},
            {"status": "bogus", "credentials": {"app_secret": secret}},
            {"credentials": {"app_secret": {"nested": secret}}},
        ]
        for bad in bad_patches:
            assert (await client.patch(url, json=bad)).status_code == 422
        assert (
            await client.patch("/v1/connections/conn-missing", json={"credentials": {"k": secret}})
        ).status_code == 404

        assert (await client.get("/v1/connections")).status_code == 200
        assert (await client.get(url)).json()["credential_fields"] == ["app_id", "app_secret"]
        assert (
            await client.patch(url, json={"name": "Wiki", "credentials": {"app_secret": replaced}})
        ).status_code == 200
        assert (await client.patch(url, json={"rag_enabled": False})).status_code == 200
        assert (await client.patch(url, json={"rag_enabled": True})).status_code == 200
        assert (await client.post("/v1/search", json={"query": "otters and kelp"})).status_code == 200
        for path in ("/openapi.json", "/metrics", "/healthz", "/readyz"):
            assert (await client.get(path)).status_code == 200

        credentials = await store.credentials(cid)
        assert credentials is not None and credentials["app_secret"].get_secret_value() == replaced
        token = bytes(await runtime.pool.fetchval("SELECT credentials FROM connections WHERE id = $1", cid))
        row = await runtime.pool.fetchval("SELECT row_to_json(c)::text FROM connections c WHERE id = $1", cid)
        assert (await client.delete(url)).status_code == 204

    provider.shutdown()
    finished = spans.get_finished_spans()
    span_text = [
        f"{span.name} {dict(span.attributes or {})} {span.status.description} "
        f"{[(event.name, dict(event.attributes or {})) for event in span.events]}"
        for span in finished
    ]
    log_text = [caplog.text] + [
        f"{record.getMessage()} {record.args!r} {record.exc_text} {record.__dict__!r}" for record in caplog.records
    ]
    http_text = [f"{response.status_code} {response.headers!r} {response.text}" for response in responses]
    metrics_text = generate_latest().decode()

    # The captures did capture: spans of every operation, the hook's failure, the change counter.
    assert {
        "connections.create",
        "connections.list",
        "connections.get",
        "connections.update",
        "connections.delete",
    } <= {span.name for span in finished}
    assert any(f"sync of {cid} could not start" in text for text in log_text)
    assert 'ragstream_connection_changes_total{operation="create"}' in metrics_text
    assert len(responses) == 20

    for planted in (secret, replaced):
        for place, texts in (("log", log_text), ("span", span_text), ("http", http_text), ("metrics", [metrics_text])):
            assert not [text for text in texts if planted in text], f"{place} shows the credential"
        assert planted not in row
        for form in encodings(planted):
            assert form not in token
    assert token.startswith(b"gAAAA")  # a Fernet token: version byte 0x80 and a timestamp, base64
    plaintext = json.dumps({"app_id": "cli_1", "app_secret": replaced}).encode()
    assert base64.urlsafe_b64encode(plaintext) not in token and base64.b64encode(plaintext) not in token
