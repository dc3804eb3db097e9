"""Issue 3, part 2: every bad input is a clear error, never a 500 and never FastAPI's 422.

One table, one real Serve app: each row is a request and the status and `param` its error must
carry. Every error is the OpenAI envelope {"error": {message, type, param, code}} with code equal
to the HTTP status. After the table, the server still answers normal requests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import PLAIN_APP, shared_app

MODEL = "shardserve/tiny-llama"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object"}}}]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
JSON = {"content-type": "application/json"}


pytestmark = pytest.mark.shared_app("plain")


@pytest.fixture(scope="module")
def root() -> str:
    return shared_app(PLAIN_APP).removesuffix("/v1")


def chat_case(case_id: str, fields: dict[str, Any], param: str | None,
              status: int = 400) -> Any:
    """A chat request: a valid body with `fields` merged in (None values delete a key)."""
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    for k, v in fields.items():
        if v is _DELETE:
            body.pop(k, None)
        else:
            body[k] = v
    return pytest.param(CHAT, {"json": body}, status, param, id=case_id)


def case(case_id: str, path: str, body: dict[str, Any], param: str | None,
         status: int = 400) -> Any:
    return pytest.param(path, {"json": body}, status, param, id=case_id)


def raw_case(case_id: str, content: bytes, param: str | None, status: int = 400,
             headers: dict[str, str] | None = None, path: str = CHAT) -> Any:
    return pytest.param(path, {"content": content, "headers": headers or JSON}, status, param,
                        id=case_id)


_DELETE = object()
N_TOO_BIG = 17  # the server's max_n is 16
DEEP = 10_000


def _valid_json(**extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}).encode()


CASES = [
    # ---- sampling ranges
    chat_case("temperature-negative", {"temperature": -0.1}, "temperature"),
    chat_case("temperature-above-2", {"temperature": 2.01}, "temperature"),
    chat_case("top_p-zero", {"top_p": 0}, "top_p"),
    chat_case("top_p-above-1", {"top_p": 1.5}, "top_p"),
    chat_case("top_k-below-minus-1", {"top_k": -2}, "top_k"),
    chat_case("top_k-fractional", {"top_k": 1.5}, "top_k"),
    chat_case("min_p-negative", {"min_p": -0.1}, "min_p"),
    chat_case("min_p-above-1", {"min_p": 1.01}, "min_p"),
    chat_case("presence_penalty-above-2", {"presence_penalty": 2.5}, "presence_penalty"),
    chat_case("presence_penalty-below-minus-2", {"presence_penalty": -2.5}, "presence_penalty"),
    chat_case("frequency_penalty-above-2", {"frequency_penalty": 3}, "frequency_penalty"),
    chat_case("frequency_penalty-below-minus-2", {"frequency_penalty": -3}, "frequency_penalty"),
    chat_case("repetition_penalty-zero", {"repetition_penalty": 0}, "repetition_penalty"),
    chat_case("repetition_penalty-negative", {"repetition_penalty": -1}, "repetition_penalty"),
    chat_case("length_penalty-not-a-number", {"length_penalty": "long"}, "length_penalty"),
    # ---- n and best_of
    chat_case("n-zero", {"n": 0}, "n"),
    chat_case("n-above-cap", {"n": N_TOO_BIG, "temperature": 1}, "n"),
    chat_case("n-2-greedy", {"n": 2, "temperature": 0}, "n"),
    chat_case("n-a-string", {"n": "two"}, "n"),
    chat_case("best_of-below-n", {"n": 3, "best_of": 2, "temperature": 1}, "best_of"),
    chat_case("best_of-zero", {"best_of": 0}, "best_of"),
    chat_case("best_of-above-cap", {"best_of": N_TOO_BIG, "temperature": 1}, "best_of"),
    chat_case("best_of-with-stream", {"best_of": 2, "temperature": 1, "stream": True},
              "best_of"),
    chat_case("best_of-greedy", {"best_of": 2, "temperature": 0}, "best_of"),
    chat_case("use_beam_search", {"use_beam_search": True}, "use_beam_search"),
    # ---- lengths
    chat_case("max_tokens-zero", {"max_tokens": 0}, "max_tokens"),
    chat_case("max_tokens-negative", {"max_tokens": -1}, "max_tokens"),
    chat_case("max_tokens-a-word", {"max_tokens": "many"}, "max_tokens"),
    chat_case("max_tokens-beyond-context", {"max_tokens": 1024}, "max_tokens"),
    chat_case("max_completion_tokens-zero", {"max_completion_tokens": 0},
              "max_completion_tokens"),
    chat_case("max_completion_tokens-beyond-context", {"max_completion_tokens": 5000},
              "max_completion_tokens"),
    chat_case("min_tokens-above-max_tokens", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    chat_case("min_tokens-negative", {"min_tokens": -1}, "min_tokens"),
    chat_case("truncate_prompt_tokens-below-minus-1", {"truncate_prompt_tokens": -2},
              "truncate_prompt_tokens"),
    chat_case("truncate_prompt_tokens-zero", {"truncate_prompt_tokens": 0},
              "truncate_prompt_tokens"),
    # ---- logprobs
    chat_case("top_logprobs-above-20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    chat_case("top_logprobs-without-logprobs", {"top_logprobs": 3}, "top_logprobs"),
    chat_case("prompt_logprobs-with-stream", {"prompt_logprobs": 1, "stream": True},
              "prompt_logprobs"),
    chat_case("prompt_logprobs-above-20", {"prompt_logprobs": 21}, "prompt_logprobs"),
    chat_case("prompt_logprobs-below-minus-1", {"prompt_logprobs": -2}, "prompt_logprobs"),
    chat_case("prompt_logprobs-whole-vocabulary", {"prompt_logprobs": -1}, "prompt_logprobs"),
    # ---- stream options
    chat_case("stream_options-without-stream", {"stream_options": {"include_usage": True}},
              "stream_options"),
    chat_case("stream-not-a-bool", {"stream": "maybe"}, "stream"),
    # ---- stop, token ids, logit bias, bad words, seed
    chat_case("stop-empty-string", {"stop": ""}, "stop"),
    chat_case("stop-list-with-empty-string", {"stop": ["end", ""]}, "stop"),
    chat_case("stop-a-number", {"stop": 5}, "stop"),
    chat_case("stop-list-of-numbers", {"stop": ["ok", 7]}, "stop[1]"),
    chat_case("logit_bias-key-not-an-int", {"logit_bias": {"hello": 5}}, "logit_bias"),
    chat_case("logit_bias-id-out-of-vocab", {"logit_bias": {"4000": 5}}, "logit_bias"),
    chat_case("logit_bias-id-negative", {"logit_bias": {"-1": 5}}, "logit_bias"),
    chat_case("logit_bias-value-not-a-number", {"logit_bias": {"5": "high"}}, "logit_bias[5]"),
    chat_case("allowed_token_ids-out-of-vocab", {"allowed_token_ids": [5, 4000]},
              "allowed_token_ids"),
    chat_case("allowed_token_ids-negative", {"allowed_token_ids": [-1]},
              "allowed_token_ids[0]"),
    chat_case("allowed_token_ids-empty", {"allowed_token_ids": []}, "allowed_token_ids"),
    chat_case("stop_token_ids-out-of-vocab", {"stop_token_ids": [4000]}, "stop_token_ids"),
    chat_case("stop_token_ids-negative", {"stop_token_ids": [3, -5]}, "stop_token_ids[1]"),
    chat_case("bad_words-empty-string", {"bad_words": [""]}, "bad_words"),
    chat_case("bad_words-blank", {"bad_words": ["ok", "   "]}, "bad_words"),
    chat_case("seed-above-int64", {"seed": 2**63}, "seed"),
    chat_case("seed-below-int64", {"seed": -(2**63) - 1}, "seed"),
    chat_case("seed-fractional", {"seed": 1.5}, "seed"),
    # ---- messages and templates
    chat_case("messages-missing", {"messages": _DELETE}, "messages"),
    chat_case("messages-empty", {"messages": []}, "messages"),
    chat_case("messages-a-string", {"messages": "hello"}, "messages"),
    chat_case("message-without-role", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    chat_case("message-content-a-number", {"messages": [{"role": "user", "content": 5}]},
              "messages[0].content"),
    chat_case("image_url-part", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
        "messages[0].content[1].type"),
    chat_case("input_audio-part", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
        "messages[0].content[0].type"),
    chat_case("unknown-content-part", {"messages": [{"role": "user", "content": [
        {"type": "hologram"}]}]}, "messages[0].content[0].type"),
    # a union field reports the member the value was meant for: here the list of parts
    chat_case("content-part-without-type", {"messages": [{"role": "user", "content": [
        {"text": "hi"}]}]}, "messages[0].content[0].type"),
    chat_case("content-part-text-a-number", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    chat_case("harmony-message-without-any-role", {"messages": [{"author": {"name": "x"},
                                                                 "content": "hi"}]},
              "messages[0].role"),
    raw_case("lone-surrogate-in-content",  # valid JSON ("\\ud800" escaped), but not text
             _valid_json(messages=[{"role": "user", "content": "a\ud800b"}]),
             "messages[0].content"),
    chat_case("add_generation_prompt-and-continue_final_message",
              {"add_generation_prompt": True, "continue_final_message": True,
               "messages": MESSAGES + [{"role": "assistant", "content": "Red"}]},
              "continue_final_message"),
    chat_case("continue_final_message-after-user", {"add_generation_prompt": False,
                                                    "continue_final_message": True},
              "continue_final_message"),
    chat_case("chat_template-syntax-error", {"chat_template": "{% for m in messages %}"},
              "chat_template"),
    chat_case("chat_template-sandbox", {"chat_template": "{{ cycler.__init__.__globals__ }}"},
              "chat_template"),
    chat_case("chat_template_kwargs-not-an-object", {"chat_template_kwargs": ["x"]},
              "chat_template_kwargs"),
    chat_case("memory_strategy-unknown", {"memory_strategy": {"name": "summarize"}},
              "memory_strategy.name"),
    chat_case("memory_strategy-k-zero", {"memory_strategy": {"name": "last_k",
                                                             "params": {"k": 0}}},
              "memory_strategy.params.k"),
    chat_case("memory_strategy-without-k", {"memory_strategy": {"name": "last_k"}},
              "memory_strategy.params"),
    # ---- tools
    chat_case("tool_choice-without-tools", {"tool_choice": "auto"}, "tool_choice"),
    chat_case("tool_choice-unknown-word", {"tools": TOOLS, "tool_choice": "sometimes"},
              "tool_choice"),
    chat_case("tool_choice-named-tool-missing", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    chat_case("tool-without-name", {"tools": [{"type": "function", "function": {}}]},
              "tools[0].function.name"),
    chat_case("tool_choice-named-without-name", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {}}}, "tool_choice.function.name"),
    chat_case("tool-type-not-function", {"tools": [{"type": "retrieval", "function": {
        "name": "x"}}]}, "tools[0].type"),
    # ---- server policy
    chat_case("cache_salt-empty", {"cache_salt": ""}, "cache_salt"),
    chat_case("priority-non-zero", {"priority": 1}, "priority"),
    chat_case("logits_processors-not-allowlisted", {"logits_processors": ["evil.Processor"]},
              "logits_processors"),
    chat_case("suffix", {"suffix": "tail"}, "suffix"),
    chat_case("modalities-audio", {"modalities": ["text", "audio"]}, "modalities"),
    chat_case("audio-output", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    chat_case("request_id-empty", {"request_id": ""}, "request_id"),
    chat_case("request_id-not-header-safe", {"request_id": "id\u00e9\U0001f600"}, "request_id"),
    chat_case("inference_timeout-zero", {"inference_timeout": 0}, "inference_timeout"),
    chat_case("unknown-model", {"model": "no-such-model"}, "model", status=404),
    # ---- bodies that are not a valid request at all
    raw_case("malformed-json", b'{"model": "x", "messages": [', None),
    raw_case("json-array-body", b'[{"model": "x"}]', None),
    raw_case("json-string-body", b'"hello"', None),
    raw_case("empty-body", b"", None),
    raw_case("non-utf8-bytes",
             b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    raw_case("ten-megabyte-body", b'{"pad": "' + b"x" * (10 * 2**20) + b'"}', None, status=413),
    raw_case("deeply-nested-10000", b'{"user": ' + b"[" * DEEP + b"]" * DEEP + b"}", None),
    raw_case("nested-100-valid-json", b'{"vllm_xargs": {"a": ' + b"[" * 100 + b"]" * 100
             + b"}, " + _valid_json()[1:], None),
    raw_case("nan-temperature", _valid_json()[:-1] + b', "temperature": NaN}', "temperature"),
    raw_case("infinite-logit-bias", _valid_json()[:-1] + b', "logit_bias": {"5": Infinity}}',
             "logit_bias[5]"),
    raw_case("text-plain", _valid_json(), None, status=415,
             headers={"content-type": "text/plain"}),
    raw_case("form-encoded", b"model=x&messages=hi", None, status=415,
             headers={"content-type": "application/x-www-form-urlencoded"}),
    # ---- /v1/completions, /tokenize, /detokenize
    case("completions-prompt-missing", CMPL, {"model": MODEL}, "prompt"),
    case("completions-prompt-empty-list", CMPL, {"model": MODEL, "prompt": []}, "prompt"),
    case("completions-prompt-id-out-of-vocab", CMPL, {"model": MODEL, "prompt": [1, 2, 4000]},
         "prompt"),
    case("completions-prompt-id-negative", CMPL, {"model": MODEL, "prompt": [1, -1]}, "prompt"),
    case("completions-prompt-lists-one-bad", CMPL, {"model": MODEL, "prompt": [[1, 2], [9999]]},
         "prompt"),
    case("completions-prompt-mixed", CMPL, {"model": MODEL, "prompt": ["a", 5]}, "prompt[1]"),
    case("completions-prompt-nested-not-int", CMPL, {"model": MODEL, "prompt": [[1, "a"]]},
         "prompt[0][1]"),
    case("completions-prompt-a-number", CMPL, {"model": MODEL, "prompt": 5}, "prompt"),
    case("completions-suffix", CMPL, {"model": MODEL, "prompt": "def f(", "suffix": "pass"},
         "suffix"),
    case("completions-logprobs-above-20", CMPL, {"model": MODEL, "prompt": "a", "logprobs": 21},
         "logprobs"),
    case("completions-max_tokens-beyond-context", CMPL,
         {"model": MODEL, "prompt": "a", "max_tokens": 1024}, "max_tokens"),
    case("completions-stream-several-prompts", CMPL,
         {"model": MODEL, "prompt": ["a", "b"], "stream": True}, "prompt"),
    raw_case("completions-lone-surrogate", json.dumps({"model": MODEL, "prompt": "x\udc00"})
             .encode(), "prompt", path=CMPL),
    case("tokenize-neither-prompt-nor-messages", "/tokenize", {"model": MODEL}, "prompt"),
    case("detokenize-id-out-of-vocab", "/detokenize", {"model": MODEL, "tokens": [4000]},
         "tokens"),
    case("detokenize-id-negative", "/detokenize", {"model": MODEL, "tokens": [-1]},
         "tokens[0]"),
]


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("path, kwargs, status, param", CASES)
def test_bad_input(root: str, path: str, kwargs: dict, status: int,
                   param: str | None) -> None:
    r = httpx.post(f"{root}{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"].endswith("Error")


@pytest.mark.parametrize("method, path, status", [("GET", CHAT, 405), ("POST", "/v1/nothing", 404),
                                                  ("DELETE", "/v1/models", 405)])
def test_wrong_routes_get_the_envelope_too(root: str, method: str, path: str,
                                           status: int) -> None:
    r = httpx.request(method, f"{root}{path}", timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status


def test_bad_streamed_request_is_refused_before_the_stream(root: str) -> None:
    """Bad streamed requests are refused before the 200, as plain JSON errors."""
    r = httpx.post(f"{root}{CHAT}", timeout=30, json={"model": MODEL, "messages": MESSAGES,
                                                      "stream": True, "temperature": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_server_still_serves_after_the_table(root: str) -> None:
    assert httpx.get(f"{root}/health", timeout=30).status_code == 200
    r = httpx.post(f"{root}{CHAT}", timeout=60, json={"model": MODEL, "messages": MESSAGES,
                                                      "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(f"{root}{CMPL}", timeout=60, json={"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
