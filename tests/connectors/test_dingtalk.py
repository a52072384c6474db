"""The DingTalk client against the fake DingTalk over real HTTP: token, search pages, blocks, errors."""

from __future__ import annotations

import httpx
import pytest
from pydantic import SecretStr

from ragstream.connectors.dingtalk import DingTalkAuthError, DingTalkClient, DingTalkError
from ragstream.vendor_http import RetryPolicy
from tests.support.fake_dingtalk import APP_KEY, APP_SECRET, OPERATOR, SEARCH_PERMISSION, FakeDingTalk

pytestmark = pytest.mark.usefixtures("private_networks")

pytest_plugins = ["tests.support.fake_dingtalk"]

QUICK = RetryPolicy(max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.02)


def client_of(fake: FakeDingTalk, *, secret: str = APP_SECRET) -> DingTalkClient:
    return DingTalkClient(SecretStr(APP_KEY), SecretStr(secret), OPERATOR, base_url=fake.base_url, retry=QUICK)


async def search(client: DingTalkClient, keyword: str, wanted: int) -> list[str]:
    return [str(item["name"]) async for item in client.search(keyword, wanted)]


async def test_one_token_serves_many_calls_and_carries_the_operator(fake_dingtalk: FakeDingTalk) -> None:
    fake_dingtalk.add("Onboarding guide", "Welcome aboard.")
    client = client_of(fake_dingtalk)
    try:
        assert await search(client, "onboarding", 5) == ["Onboarding guide"]
        assert await search(client, "guide", 5) == ["Onboarding guide"]
    finally:
        await client.aclose()
    assert fake_dingtalk.token_requests == 1
    assert [query["operatorId"] for query in fake_dingtalk.searches()] == [OPERATOR, OPERATOR]


async def test_a_token_refused_later_is_fetched_again_once(fake_dingtalk: FakeDingTalk) -> None:
    fake_dingtalk.add("Release notes")
    client = client_of(fake_dingtalk)
    try:
        assert await search(client, "release", 5) == ["Release notes"]
        fake_dingtalk.revoke_tokens()
        assert await search(client, "release", 5) == ["Release notes"]
    finally:
        await client.aclose()
    assert fake_dingtalk.token_requests == 2


@pytest.mark.parametrize("empty_next_token", [False, True])
async def test_search_follows_next_token_to_the_last_page(fake_dingtalk: FakeDingTalk, empty_next_token: bool) -> None:
    fake_dingtalk.empty_next_token = empty_next_token
    names = [f"Plan {number}" for number in range(120)]
    for name in names:
        fake_dingtalk.add(name)
    client = client_of(fake_dingtalk)
    try:
        assert await search(client, "plan", 200) == names
        assert await search(client, "plan", 7) == names[:7]
    finally:
        await client.aclose()
    pages = fake_dingtalk.searches()
    assert len(pages) == 3 + 1  # 50 + 50 + 20, then one page of 7


async def test_wrong_app_credentials_fail_clearly_without_the_secret(fake_dingtalk: FakeDingTalk) -> None:
    client = client_of(fake_dingtalk, secret="wrong-secret-value")
    try:
        with pytest.raises(DingTalkAuthError) as raised:
            await search(client, "anything", 5)
    finally:
        await client.aclose()
    assert "wrong-secret-value" not in str(raised.value)


async def test_a_missing_permission_is_a_permanent_error(fake_dingtalk: FakeDingTalk) -> None:
    fake_dingtalk.permissions.discard(SEARCH_PERMISSION)
    client = client_of(fake_dingtalk)
    try:
        with pytest.raises(DingTalkError) as raised:
            await search(client, "anything", 5)
    finally:
        await client.aclose()
    assert raised.value.code == "Forbidden.AccessDenied.AccessTokenPermissionDenied"
    assert not raised.value.retryable and len(fake_dingtalk.searches()) == 1


async def test_qps_throttling_and_server_errors_are_retried(fake_dingtalk: FakeDingTalk) -> None:
    fake_dingtalk.add("Budget 2026")
    fake_dingtalk.throttles = 1
    fake_dingtalk.search_failures.append(500)
    client = client_of(fake_dingtalk)
    try:
        assert await search(client, "budget", 5) == ["Budget 2026"]
    finally:
        await client.aclose()
    assert len(fake_dingtalk.searches()) == 3


async def test_blocks_of_online_documents_only(fake_dingtalk: FakeDingTalk) -> None:
    online = fake_dingtalk.add("Runbook", "Restart the broker.", "Then check the lag.")
    pdf = fake_dingtalk.add("Scan", category="pdf")
    client = client_of(fake_dingtalk)
    try:
        blocks = await client.blocks(online.uuid)
        with pytest.raises(DingTalkError):
            await client.blocks(pdf.uuid)
    finally:
        await client.aclose()
    assert [block["paragraph"]["text"] for block in blocks] == ["Restart the broker.", "Then check the lag."]


async def test_the_fake_refuses_a_call_without_operator_id(fake_dingtalk: FakeDingTalk) -> None:
    async with httpx.AsyncClient(base_url=fake_dingtalk.base_url) as raw:
        token = (await raw.post("/v1.0/oauth2/accessToken", json={"appKey": APP_KEY, "appSecret": APP_SECRET})).json()
        answer = await raw.post(
            "/v2.0/storage/dentries/search",
            json={"keyword": "x", "option": {"maxResults": 5}},
            headers={"x-acs-dingtalk-access-token": token["accessToken"]},
        )
    assert (answer.status_code, answer.json()["code"]) == (400, "MissingoperatorId")
