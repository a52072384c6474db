"""The shared vendor HTTP machinery: platform waits, the retry loop, redaction, the one client factory."""

from __future__ import annotations

import re
import time
from email.utils import formatdate
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from ragstream import vendor_http
from ragstream.vendor_http import RetryPolicy, Transient, VendorError, VendorHttp, redact, retry_after


@pytest.mark.parametrize(
    ("headers", "low", "high"),
    [
        ({"Retry-After": "7"}, 7.0, 7.0),
        ({"Retry-After": "http-date +30"}, 28.0, 30.0),
        ({"X-RateLimit-Reset": "12"}, 12.0, 12.0),
        ({"X-RateLimit-Reset": "unix +20"}, 18.0, 20.0),  # a Unix time, not seconds
        ({"Retry-After": "3", "X-RateLimit-Reset": "40"}, 3.0, 3.0),  # Retry-After first
        ({"X-RateLimit-Reset": "-5"}, 0.0, 0.0),
    ],
)
def test_the_platforms_wait_is_read_from_its_headers(headers: dict[str, str], low: float, high: float) -> None:
    """Times are filled in when the test runs: ``http-date +N`` and ``unix +N`` are N seconds ahead."""
    now = time.time()
    for name, value in headers.items():
        if value.startswith("http-date +"):
            headers[name] = formatdate(now + float(value.removeprefix("http-date +")), usegmt=True)
        elif value.startswith("unix +"):
            headers[name] = str(int(now + float(value.removeprefix("unix +"))))
    wait = retry_after(httpx.Response(429, headers=headers), "x-ratelimit-reset")
    assert wait is not None and low <= wait <= high


def test_no_wait_without_the_headers() -> None:
    assert retry_after(httpx.Response(429, headers={"X-RateLimit-Reset": "soon"}), "x-ratelimit-reset") is None
    assert retry_after(httpx.Response(429)) is None


@pytest.mark.usefixtures("private_networks")
async def test_the_retry_loop_gives_up_with_the_platform_error_and_no_secret() -> None:
    calls: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503, text="upstream echoed sk-SECRET")

    http = VendorHttp(
        "demo",
        "https://127.0.0.1",  # the mock answers below the outbound gate
        headers={"Authorization": "Bearer sk-SECRET"},
        retry=RetryPolicy(max_retries=2, backoff_initial_s=0.001, backoff_max_s=0.002),
        transport=httpx.MockTransport(answer),
        secrets=lambda: ["sk-SECRET"],
    )

    async def once() -> str:
        response = await http.send("GET", "/thing")
        raise Transient(VendorError(http.redact(f"HTTP {response.status_code}: {response.text}"), retryable=True))

    try:
        with pytest.raises(VendorError) as failed:
            await http.retrying(once, "/thing")
    finally:
        await http.aclose()
    assert len(calls) == 3 and calls[0].headers["authorization"] == "Bearer sk-SECRET"
    assert str(failed.value) == "HTTP 503: upstream echoed *** (gave up after 3 attempts)"
    assert failed.value.retryable and failed.value.__cause__ is None
    assert redact("a sk-SECRET b", ["", "sk-SECRET"]) == "a *** b"


@pytest.mark.usefixtures("private_networks")
async def test_every_attempt_is_counted_by_vendor_and_outcome() -> None:
    answers = iter([httpx.Response(503), httpx.Response(200, json={})])
    vendor = f"metrics-{time.monotonic_ns()}"  # series of its own, whatever other tests counted
    http = VendorHttp(
        vendor,
        "https://127.0.0.1",
        retry=RetryPolicy(max_retries=2, backoff_initial_s=0.001, backoff_max_s=0.002),
        transport=httpx.MockTransport(lambda request: next(answers)),
    )

    async def once() -> int:
        response = await http.send("GET", "/thing")
        if response.status_code >= 500:
            raise Transient(VendorError(f"HTTP {response.status_code}", retryable=True))
        return response.status_code

    try:
        assert await http.retrying(once, "/thing") == 200
    finally:
        await http.aclose()

    def sample(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"vendor": vendor, **labels})

    assert sample("ragstream_vendor_requests_total", outcome="5xx") == 1
    assert sample("ragstream_vendor_requests_total", outcome="2xx") == 1
    assert sample("ragstream_vendor_request_seconds_count") == 2


def test_http_clients_are_built_only_by_the_factory() -> None:
    """The outbound gate covers every vendor only if no code in the package but the gate's own module
    builds an httpx client (``vendor_http.build_client`` and the onnx download go through it)."""
    package = Path(vendor_http.__file__).parent
    builders = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(r"httpx\.(Async)?Client\(", path.read_text(encoding="utf-8"))
    }
    assert builders == {"outbound.py"}
