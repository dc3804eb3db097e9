"""Issue 17: every list a request sends is capped, and going over a cap is a 400 whose `param` is
the field and whose message says the limit and what was sent. Checked where the ingress checks
them: the pydantic models (through the same error mapping as the HTTP path) and `sampling.build`.
Over HTTP against a real app: tests/reliability/test_caps.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from serve_app import protocol as p
from serve_app.errors import APIError, validation_error
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from serve_app.sampling import ServerLimits, build

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}


def _error(model: type[BaseModel], body: dict[str, Any]) -> APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value)  # type: ignore[arg-type]  # as the ingress does


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, **fields}


# (field, a value at the cap, the cap, how to make a list of n)
LISTS = [
    ("stop", p.MAX_STOP, lambda n: [f"s{i}" for i in range(n)]),
    ("stop_token_ids", p.MAX_STOP_TOKEN_IDS, lambda n: [1] * n),
    ("bad_words", p.MAX_BAD_WORDS, lambda n: [f"w{i}" for i in range(n)]),
    ("logit_bias", p.MAX_LOGIT_BIAS, lambda n: {str(i): 1.0 for i in range(n)}),
    ("allowed_token_ids", p.MAX_ALLOWED_TOKEN_IDS, lambda n: [1] * n),
    ("logits_processors", p.MAX_LOGITS_PROCESSORS, lambda n: ["x"] * n),
    ("tools", p.MAX_TOOLS, lambda n: [TOOL] * n),
    ("messages", p.MAX_MESSAGES, lambda n: MESSAGES * n),
]


@pytest.mark.parametrize(("field", "cap", "make"), LISTS, ids=[f for f, _, _ in LISTS])
def test_a_list_at_its_cap_passes_and_one_more_is_a_400_naming_the_field(
        field: str, cap: int, make: Any) -> None:
    ChatCompletionRequest.model_validate(_chat(**{field: make(cap)}))
    err = _error(ChatCompletionRequest, _chat(**{field: make(cap + 1)}))
    assert (err.status, err.param) == (400, field)
    assert f"at most {cap} " in err.message and f"got {cap + 1}" in err.message


def test_the_count_is_checked_before_the_items_are_parsed() -> None:
    # items that are not messages at all: the count is what is reported, not 2,049 item errors
    err = _error(ChatCompletionRequest, {"messages": [0] * (p.MAX_MESSAGES + 1)})
    assert err.param == "messages" and f"got {p.MAX_MESSAGES + 1}" in err.message


@pytest.mark.parametrize(("field", "value", "where"), [
    ("stop", "x" * (p.MAX_STOP_CHARS + 1), "stop has"),
    ("stop", ["ok", "x" * (p.MAX_STOP_CHARS + 1)], "stop[1] has"),
    ("bad_words", ["ok", "ok", "x" * (p.MAX_BAD_WORD_CHARS + 1)], "bad_words[2] has"),
])
def test_a_stop_string_or_bad_word_too_long_is_a_400_saying_which(field: str, value: Any,
                                                                   where: str) -> None:
    err = _error(ChatCompletionRequest, _chat(**{field: value}))
    assert (err.status, err.param) == (400, field)
    cap = p.MAX_STOP_CHARS if field == "stop" else p.MAX_BAD_WORD_CHARS
    assert f"{where} {cap + 1} characters" in err.message and f"at most {cap}" in err.message
    ChatCompletionRequest.model_validate(_chat(stop="x" * p.MAX_STOP_CHARS,
                                               bad_words=["x" * p.MAX_BAD_WORD_CHARS]))


def test_completions_prompt_lists_are_capped_but_one_long_token_prompt_is_one_prompt() -> None:
    CompletionRequest.model_validate({"prompt": ["a"] * p.MAX_PROMPTS})
    for prompts in (["a"] * (p.MAX_PROMPTS + 1), [[1, 2]] * (p.MAX_PROMPTS + 1)):
        err = _error(CompletionRequest, {"prompt": prompts})
        assert err.param == "prompt" and f"at most {p.MAX_PROMPTS} prompts" in err.message
    CompletionRequest.model_validate({"prompt": [1] * (p.MAX_PROMPTS + 1)})


def test_tokenize_requests_have_the_same_message_and_tool_caps() -> None:
    assert _error(TokenizeRequest, {"messages": MESSAGES * (p.MAX_MESSAGES + 1)}).param == \
        "messages"
    assert _error(TokenizeRequest, {"prompt": "x", "tools": [TOOL] * (p.MAX_TOOLS + 1)}).param \
        == "tools"


class _CharTokenizer:
    """One token per character: a word of k characters is k tokens, k + 1 with its space."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]


def _build(words: list[str]) -> Any:
    limits = ServerLimits(max_model_len=1024, vocab_size=100, max_n=4,
                          priority_scheduling=False, logits_processors=frozenset())
    request = ChatCompletionRequest.model_validate(_chat(max_tokens=4, bad_words=words))
    return build(request, prompt_len=5, limits=limits, tokenizer=_CharTokenizer(), chat=True)


def test_the_bad_words_tokens_are_capped_in_total() -> None:
    # 128 words of 7 characters are 128 * (7 + 8) = 1,920 tokens; of 9, 128 * 19 = 2,432
    assert 128 * 15 <= p.MAX_BAD_WORDS_TOKENS < 128 * 19 and p.MAX_BAD_WORDS == 128
    params, _ = _build([f"{i:03d}abcd" for i in range(128)])
    assert sum(map(len, params.bad_words_token_ids)) == 128 * 15
    with pytest.raises(APIError) as info:
        _build([f"{i:03d}abcdef" for i in range(128)])
    assert (info.value.status, info.value.param) == (400, "bad_words")
    assert "2432 tokens" in info.value.message
    assert f"at most {p.MAX_BAD_WORDS_TOKENS}" in info.value.message
