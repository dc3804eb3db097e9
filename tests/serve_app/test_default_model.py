"""The default model a user meets (`make serve`): SmolLM2-135M-Instruct from its Q4_1 GGUF, served
with its weights quantized, answers sensibly through the openai SDK: a fact, JSON that validates,
a stream, tool calls; a request without sampling fields samples with the model's defaults; a
request's own chat template is refused, as by any server that does not trust them."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
from openai import OpenAI

from replicas.embedded import DEFAULT_MODEL_ID
from replicas.kernels import isa
from tests.conftest import shared_app

pytestmark = [pytest.mark.shared_app("default-model"),
              pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                 reason="the CPU build's quantized kernels are under test")]

CONFIG = {"models": [{"model": DEFAULT_MODEL_ID, "max_model_len": 2048, "kv_cache_gib": 0.1,
                      "max_num_seqs": 8, "num_threads": 2, "replica_num_cpus": 1.0}]}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def client() -> OpenAI:
    url = shared_app(CONFIG)
    return OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)


def test_version_names_the_weight_formats(client: OpenAI) -> None:
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    deadline = time.monotonic() + 30
    while not (models := httpx.get(f"{root}/version").json()["models"]):
        assert time.monotonic() < deadline, "no replica reported"
        time.sleep(0.5)
    assert models[DEFAULT_MODEL_ID]["dtype"] == "float32"
    # the quantized checkpoint's cache in 16 bits beside float32 compute (--kv-cache-dtype auto)
    assert models[DEFAULT_MODEL_ID]["kv_cache_dtype"] == "bfloat16"
    assert models[DEFAULT_MODEL_ID]["weights"] == {"Q8_0 embedding": 1, "Q4_1 linear_q": 120,
                                                   "Q8_0 linear_q": 1}
    # bfloat16 where the CPU has AVX512-BF16 dot products (kernels.quant_activations)
    assert models[DEFAULT_MODEL_ID]["quant_activations"] == (
        "bfloat16" if isa.selected() in ("amx_bf16", "avx512_bf16") else "float32")


def test_a_fact_greedy(client: OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=FRANCE, temperature=0,
                                       max_tokens=24)
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_json_schema_validates_and_arrays_stay_bounded(client: OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "tags": {"type": "array", "items": {"type": "string",
                                                                 "maxLength": 12},
                                      "maxItems": 3}}}
    for temperature in (0, None):  # greedy, and the model's own sampling defaults
        r = client.chat.completions.create(
            model=DEFAULT_MODEL_ID, max_tokens=200,
            messages=[{"role": "user", "content": "Describe a cat as JSON with name and tags."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "cat", "schema": schema, "strict": True}},
            **({} if temperature is None else {"temperature": temperature}))
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"


def test_a_stream(client: OpenAI) -> None:
    stream = client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=FRANCE,
                                            temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    # a message may carry several tokens; the end-of-turn token carries no text
    assert chunks[-1].usage.completion_tokens >= len(
        [c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls(client: OpenAI, tool_choice) -> None:
    # one call (with parallel calls allowed a small model may go on writing more until
    # max_tokens); greedy, so the run is the same every time
    r = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, max_tokens=100, tools=[WEATHER], tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_request_template_is_refused_by_a_server_that_does_not_trust_them(
        client: OpenAI, path: str) -> None:
    """`make serve` does not trust request templates (--trust-request-chat-template, as vLLM):
    a request's own `chat_template` is a 400 naming it, before any rendering."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    r = httpx.post(f"{root}{path}", timeout=60, json={
        "model": DEFAULT_MODEL_ID, "messages": FRANCE, "chat_template": "{{ messages }}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and "trust" in error["message"], error
