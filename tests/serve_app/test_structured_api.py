"""Structured outputs through the real app: every constraint form, streaming and not, n > 1,
concurrent requests with their own schemas mixed with free ones, tool_choice, reasoning, limits.
The random-weight model writes whatever the mask leaves it, so a valid output is the constraint's
doing."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import PLAIN_APP, shared_app

MODEL = "shardserve/tiny-llama"
MSG = [{"role": "user", "content": "Answer in the required format."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


pytestmark = pytest.mark.shared_app("plain")


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(PLAIN_APP)  # a compile limit of 2 s


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def chat(client: OpenAI, **kwargs) -> object:
    return client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=120, **kwargs)


def test_json_schema_non_stream_and_stream_n2(client: OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(client, response_format=rf, n=2, seed=3)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    parts: dict[int, str] = {}
    for chunk in chat(client, response_format=rf, n=2, seed=3, stream=True):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert [parts[0], parts[1]] == [c.message.content for c in r.choices]


def test_aliases_and_forms(client: OpenAI) -> None:
    r = chat(client, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = chat(client, extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # any object is allowed, so a random model may write one long string until max_tokens;
    # favouring the closing characters (among what the mask allows) makes it finish
    root = str(client.base_url).removesuffix("/v1/")
    closers = {str(httpx.post(f"{root}/tokenize", json={"prompt": ch}).json()["tokens"][0]): 50
               for ch in ('"', "}")}
    r = chat(client, response_format={"type": "json_object"}, n=2, seed=1,
             logit_bias=closers)
    for c in r.choices:
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.message.content), dict)
    pattern = r"[A-Z]{2}-[0-9]{3}(\.[0-9])?"
    for body in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        r = chat(client, extra_body=body)
        assert re.fullmatch(pattern, r.choices[0].message.content)
    choices = ["alpha", "beta", "日本語"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = chat(client, extra_body=body)
        assert r.choices[0].message.content in choices


def test_grammar_lark(client: OpenAI) -> None:
    grammar = 'start: expr\nexpr: NUMBER (("+" | "*") NUMBER)*\nNUMBER: /[0-9]{1,3}/\n'
    r = chat(client, extra_body={"guided_grammar": grammar})
    text = r.choices[0].message.content
    assert re.fullmatch(r"[0-9]{1,3}([+*][0-9]{1,3})*", text), text


def test_16_concurrent_own_schemas_mixed_with_free(base_url: str) -> None:
    aclient = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
    schemas = [{"type": "object", "additionalProperties": False, "required": [f"k{i}"],
                "properties": {f"k{i}": {"type": "integer", "minimum": i, "maximum": i + 5}}}
               for i in range(16)]

    async def constrained(i: int) -> None:
        r = await aclient.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=60, stream=i % 2 == 0,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                    "schema": schemas[i]}})
        if i % 2 == 0:
            text = "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
        else:
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), schemas[i])

    async def free(i: int) -> None:
        r = await aclient.chat.completions.create(model=MODEL, messages=MSG, max_tokens=30,
                                                  extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 30

    async def main() -> None:
        await asyncio.gather(*(constrained(i) for i in range(16)), *(free(i) for i in range(8)))
    asyncio.run(main())


def test_tool_choice_named_and_required(client: OpenAI) -> None:
    params = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": params}}]
    r = chat(client, tools=tools, tool_choice={"type": "function",
                                               "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), params)
    r = chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(calls[0].function.arguments), params)


def test_constraint_starts_after_reasoning(client: OpenAI) -> None:
    # the prompt leaves the model inside <think>; forcing </think> ends the reasoning at once
    end_think = 3997
    r = client.chat.completions.create(
        model=MODEL, max_tokens=80,
        messages=[*MSG, {"role": "assistant", "content": "<think>\n"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "logit_bias": {str(end_think): 100}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


@pytest.mark.parametrize("body, keyword", [
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "not"),
    ({"guided_json": {"type": "array", "contains": {"type": "string"}}}, "contains"),
    ({"guided_regex": "(?=a)b"}, None),
    ({"guided_regex": r"(a)\1"}, None),
    ({"guided_json": {"type": "nonsense"}}, None),
    ({"guided_json": PERSON, "guided_regex": "a+"}, None),
])
def test_unsupported_constraints_are_400(base_url: str, body: dict, keyword: str | None) -> None:
    r = httpx.post(f"{base_url}/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MSG, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"]
    if keyword:
        assert keyword in err["message"]


def test_slow_regex_times_out_while_streams_continue(base_url: str) -> None:
    progress = [0] * 8
    stop = threading.Event()

    def stream(i: int) -> None:
        # long enough to outlast the compile window however fast the engine is (stopped early)
        body = {"model": MODEL, "messages": MSG, "max_tokens": 900, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    progress[i] += 1
                if stop.is_set():
                    break

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = sum(progress)
    started = time.monotonic()
    r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MSG, "max_tokens": 20,
        "guided_regex": r"[A-Z][^.!?\n]{0,150}[.!?] [A-Z][^.!?\n]{0,150}[.!?]"})
    elapsed = time.monotonic() - started
    during = sum(progress) - before
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert r.status_code == 400 and "took longer" in r.json()["error"]["message"]
    assert elapsed < 2.0 + 1.0 + 1.0  # the limit, plus 1 s, plus the HTTP path on a busy CPU
    assert during > 8  # the other streams kept producing tokens meanwhile


def _tokens_of(client: OpenAI, text: str) -> list[int]:
    root = str(client.base_url).removesuffix("/v1/")
    return httpx.post(f"{root}/tokenize", json={"prompt": text}).json()["tokens"]


def test_forced_tokens_obey_the_requests_lists(client: OpenAI) -> None:
    """A regex that forces a literal jumps forward only where the request sets no lists: with
    allowed_token_ids, bad_words or stop_token_ids the forced tokens are sampled one by one
    through them, so a forbidden one ends the output (finish_reason "abort", with the reason)
    instead of slipping through, and a stop token stops it."""
    literal = "hello world and more"
    base = {"guided_regex": literal, "return_token_ids": True}
    jumped = chat(client, temperature=0, extra_body=base)
    assert jumped.choices[0].message.content == literal
    # an unrelated stop token: the same literal, token by token
    stepped = chat(client, temperature=0, extra_body={**base, "stop_token_ids": [3992]})
    assert stepped.choices[0].message.content == literal
    ids = stepped.choices[0].token_ids
    c = chat(client, temperature=0, extra_body={**base, "allowed_token_ids": ids[:2]}).choices[0]
    assert c.finish_reason == "abort" and "no token is allowed" in c.stop_reason
    assert c.token_ids == ids[:2]
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])
    c = chat(client, temperature=0, extra_body={**base, "stop_token_ids": [ids[k]]}).choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == ids[k]
    assert c.token_ids == ids[:k + 1]


def test_a_request_whose_lists_leave_no_token_is_a_400(client: OpenAI) -> None:
    he = _tokens_of(client, "he")
    assert len(he) == 1
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, extra_body={"allowed_token_ids": he, "bad_words": ["he"]})
    assert exc.value.body["param"] == "allowed_token_ids"


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_strict_and_disable_fallback_are_honoured(client: OpenAI,
                                                              strict: bool | None) -> None:
    """The output always conforms to the schema, so `strict: true` holds, and `strict: false`
    (OpenAI: best effort) gets the stronger guarantee; each kind of constraint has one backend
    and never falls back to another, so `disable_fallback: true` holds as well."""
    schema = {"name": "person", "schema": PERSON,
              **({"strict": strict} if strict is not None else {})}
    r = chat(client, response_format={"type": "json_schema", "json_schema": schema}, seed=5)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = chat(client, extra_body={"structured_outputs": {"json": PERSON,
                                                        "disable_fallback": True}}, seed=5)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
