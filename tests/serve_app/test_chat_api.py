"""The whole path through a real Serve app behind HAProxy (what `shardserve serve` runs): the openai
client, streaming and not, SSE framing, usage, n, seeds, stop strings, disconnects, and bad input.
The other integration modules run behind Serve's Python proxy."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from tests.conftest import PLAIN_APP, shared_app

MODEL = "shardserve/tiny-llama"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


pytestmark = pytest.mark.shared_app("plain")


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(PLAIN_APP)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def sse_events(base_url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    for e in events[:-1]:
        assert e.startswith("data: "), e
    return [e[len("data: "):] for e in events[:-1]]


def test_models_list(client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_chat_completion(client: OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    tokenized = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                           json={"messages": MESSAGES}).json()
    assert r.usage.prompt_tokens == tokenized["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_metrics_name_the_compute_dtype_and_kernel_isa(base_url: str) -> None:
    from replicas.kernels import isa
    expected = "gpu" if torch.cuda.is_available() else isa.selected()
    deadline = time.monotonic() + 5  # the replicas report every 0.5 s
    while True:
        text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
        info = [line for line in text.splitlines() if line.startswith("shardserve:model_info{")]
        if info or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # the embedded model is a float32 checkpoint: float32 on every CPU
    assert info == [f'shardserve:model_info{{dtype="float32",isa="{expected}",'
                    f'model_name="{MODEL}"}} 1.0'], info


def test_sse_framing_and_usage(base_url: str) -> None:
    events = sse_events(base_url, {"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                                   "stream": True, "stream_options": {"include_usage": True},
                                   "ignore_eos": True, "temperature": 0})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    body = [c for c in chunks if c["choices"]]
    assert all(len(c["choices"]) == 1 for c in body)
    assert body[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0].get("finish_reason") is None for c in body[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_stream_concatenates_to_non_stream(client: OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=20, seed=42, temperature=0.9)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(parts) == full


def _counter(base_url: str, name: str) -> float:
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_concurrent_requests_share_the_ingress_channel(base_url: str, client: OpenAI) -> None:
    """After the module's first requests the ingress has its channel to the replica open, so
    these requests' tokens come over it: one message per engine step for all of them rather
    than one per request per step. What each streams is what it answers unstreamed."""
    channeled, messages = (f"shardserve:replica_{n}_total"
                           for n in ("channeled_requests", "stream_messages"))
    time.sleep(1.2)  # the replicas report every 0.5 s
    before = _counter(base_url, channeled), _counter(base_url, messages)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.9,
                  extra_body={"ignore_eos": True})
    # a channel idle for 2 s has ended: this request opens it again if so (over its own call)
    client.chat.completions.create(**{**kwargs, "max_tokens": 48})

    def streamed(seed: int) -> str:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **kwargs, seed=seed, stream=True) if c.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(streamed, range(16)))
        whole = list(pool.map(lambda seed: client.chat.completions.create(
            **kwargs, seed=seed).choices[0].message.content, range(16)))
    assert texts == whole and len(set(texts)) > 1
    deadline = time.monotonic() + 5
    while (_counter(base_url, channeled) < before[0] + 32) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _counter(base_url, channeled) - before[0] in (32, 33)
    # 32 requests x 24 tokens in two waves of ~25-35 engine steps (measured: 50-64 messages)
    # and the first request's 48; over their own calls they would take one a token (816: the
    # replica does not group them)
    assert _counter(base_url, messages) - before[1] < 250


def test_seed_reproducible_and_n(client: OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, seed=7, n=2, temperature=1.0,
                  extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    assert a.usage.completion_tokens == 32  # counted over both choices


def test_n_streams_each_choice(base_url: str) -> None:
    events = sse_events(base_url, {"model": MODEL, "messages": MESSAGES, "max_tokens": 5,
                                   "n": 2, "stream": True, "ignore_eos": True})
    chunks = [json.loads(e) for e in events[:-1]]
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0].get("finish_reason")}
    assert finished == {0, 1}


def test_stop_string_cuts_output(client: OpenAI) -> None:
    base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                          temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].message.content
    stop = text[5:8]
    assert len(stop) == 3
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                         temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    kept = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[: text.index(stop) + len(stop)]


def _engine_gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    out = {}
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_disconnect_mid_stream_frees_the_request(base_url: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 900, "stream": True, "n": 16,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        # the gauges come from the replicas' reports, up to ~1 s old
        deadline = time.monotonic() + 3
        while (_engine_gauges(base_url)["vllm:num_requests_running"] < 1
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert _engine_gauges(base_url)["vllm:num_requests_running"] >= 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        g = _engine_gauges(base_url)
        if g["vllm:num_requests_running"] == 0 and g["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert g == {"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0}


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages[0].role"),
])
def test_bad_bodies_get_400_envelope(base_url: str, body: dict, param: str) -> None:
    r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 400 and err["param"] == param and err["message"]


def test_malformed_json_and_unknown_model(base_url: str, client: OpenAI) -> None:
    r = httpx.post(f"{base_url}/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert err.value.body["param"] == "model"
    # still serving afterwards
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.content is not None
