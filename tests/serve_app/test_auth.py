"""API keys: a server started with keys (`api_keys`, and a key file) takes any of them as
`Authorization: Bearer` or `x-api-key`, answers anything else with a 401 envelope, and leaves
/health, /metrics, /version open."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import SMALL_MODEL, shared_app

MODEL = "shardserve/tiny-llama"
KEY = "sk-test-0123456789"
FILE_KEY = "sk-from-a-file"
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT_BODY = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}

pytestmark = pytest.mark.shared_app("auth")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key a line\n{FILE_KEY}\n\n")
    return shared_app({"models": [SMALL_MODEL], "api_keys": [KEY],
                       "api_key_file": str(key_file), "max_requests_per_key": 2})


@pytest.fixture(scope="module")
def root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 401 and err["type"] == "AuthenticationError" and err["message"]


@pytest.mark.parametrize("headers", [
    {"Authorization": f"Bearer {KEY}"},
    {"authorization": f"bearer {KEY}"},
    {"Authorization": f"Bearer   {KEY}"},
    {"x-api-key": KEY},
    {"X-API-Key": KEY, "Authorization": "Basic dXNlcjpwYXNz"},
    {"Authorization": f"Bearer {FILE_KEY}"},
])
def test_the_key_is_accepted(base_url: str, headers: dict) -> None:
    r = httpx.post(f"{base_url}/chat/completions", json=CHAT_BODY, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": KEY},  # no scheme
    {"Authorization": f"Basic {KEY}"},
    {"x-api-key": "wrong"},
    {"x-api-key": ""},
    {"Authorization": "Bearer"},
    {"x-api-key": KEY.upper()},
    {"x-api-key": KEY[:-1]},
    {"x-api-key": KEY + FILE_KEY},
    {"Authorization": "Bearer # one key a line"},
])
def test_anything_else_is_401(base_url: str, headers: dict) -> None:
    assert_401(httpx.post(f"{base_url}/chat/completions", json=CHAT_BODY, headers=headers,
                          timeout=30))


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
])
def test_every_api_route_is_guarded(root: str, method: str, path: str, body: dict | None) -> None:
    assert_401(httpx.request(method, f"{root}{path}", json=body, timeout=30))
    ok = httpx.request(method, f"{root}{path}", json=body, timeout=60,
                       headers={"x-api-key": KEY})
    assert ok.status_code == 200, ok.text


def test_auth_comes_before_body_validation(base_url: str) -> None:
    """An unauthenticated caller learns nothing about the request's validity."""
    assert_401(httpx.post(f"{base_url}/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=30))
    assert_401(httpx.post(f"{base_url}/chat/completions", json={"model": "nope"}, timeout=30))


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/ping"])
def test_operational_routes_are_open(root: str, path: str) -> None:
    assert httpx.get(f"{root}{path}", timeout=30).status_code == 200


def test_openai_client_with_and_without_the_key(base_url: str) -> None:
    good = OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)
    assert good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices
    assert [m.id for m in good.models.list().data] == [MODEL]
    bad = OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.body["code"] == 401


def test_streaming_needs_the_key_too(base_url: str) -> None:
    body = {**CHAT_BODY, "stream": True}
    assert_401(httpx.post(f"{base_url}/chat/completions", json=body, timeout=30))
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert "".join(r.iter_text()).endswith("data: [DONE]\n\n")


def test_a_key_over_its_concurrency_limit_gets_429(base_url: str) -> None:
    """max_requests_per_key=2: of 6 requests sent at once with one key, those beyond the 2 in
    flight are 429s with Retry-After (the openai SDK retries them); another key is not
    affected; the key's places come back when its requests end."""
    # 4 x 400 tokens (~1-2 s): the first two are still generating when the last ones arrive,
    # milliseconds after them
    body = {**CHAT_BODY, "max_tokens": 400, "ignore_eos": True, "n": 4}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            def post(key: str) -> Any:
                return client.post(f"{base_url}/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"})
            return await asyncio.gather(*(post(KEY) for _ in range(6)), post(FILE_KEY))
    *same, other = asyncio.run(burst())
    codes = sorted(r.status_code for r in same)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    for r in same:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "RateLimitError"
            assert int(r.headers["retry-after"]) >= 1
    assert other.status_code == 200, other.text
    r = httpx.post(f"{base_url}/chat/completions", json=CHAT_BODY, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
