"""Reasoning and tool-call parsing (serve_app/tool_parser.py) and the per-choice output state
(serve_app/stream.py) without Ray: text split anywhere parses as it does whole, bad tool JSON
falls back to content, reasoning and tools together, finish_reason tool_calls, stop tokens,
logprob bytes, fed with real token ids of the embedded tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from replicas.embedded import EMBEDDED_MODEL_ID
from replicas.model_files import resolve_model_path
from replicas.request import TokenBatch, TokenLogprob
from serve_app.sampling import OutputOptions
from serve_app.stream import ChoiceState, TokenText
from serve_app.reasoning_formats import FORMATS as REASONING
from serve_app.tool_formats import FORMATS as TOOLS
from serve_app.tool_parser import OutputParser

QWEN3, HERMES = REASONING["qwen3"], TOOLS["hermes"]


def hermes_parser(reasoning: bool, include: bool, tools: bool, **kw) -> OutputParser:
    return OutputParser(QWEN3 if reasoning else None, include, HERMES if tools else None, **kw)

IM_END = 3993

CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
        '\n</tool_call>')
TWO_CALLS = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
             '<tool_call>{"name": "b", "parameters": {"y": [1, 2]}}</tool_call>')
TEXTS = [
    "plain answer, no tags at all",
    "<think>\nstep 1, step 2\n</think>\n\nThe answer is 4.",
    "  <think>leading spaces</think>after",
    "\n" * 12 + "<think>too far in to open reasoning</think>",
    "Let me check. " + CALL,
    "<think>I should call a tool</think>\n\n" + CALL + "\nDone.",
    TWO_CALLS,
    "<tool_call>{not json}</tool_call> and text",
    "<tool_call>{\"arguments\": {}}</tool_call>",  # no name: not a call
    "text with a lone < and <tool and <thi inside",
    "not reasoning <think>x</think> because it is not at the start",
    "<think>never closed, all reasoning",
    '<tool_call>{"name": "late", "arguments": {"k": "v"}}',  # unterminated but valid JSON
    "<tool_call>{\"name\": \"broken\", ",  # unterminated and invalid
    '中文 😀 <think>x</think> <tool_call>{"name": "u", "arguments": {"s": "é😀"}}</tool_call>',
]


def parse(pieces: list[str], reasoning: bool = True, include: bool = True,
          tools: bool = True) -> tuple[str, str, list[tuple[str, dict]]]:
    p = hermes_parser(reasoning, include, tools)
    content, thinking, calls = "", "", []
    for piece in pieces:
        d = p.feed(piece)
        content, thinking, calls = content + d.content, thinking + d.reasoning, calls + d.tool_calls
    d = p.flush()
    content, thinking, calls = content + d.content, thinking + d.reasoning, calls + d.tool_calls
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [c.index for c in p.tool_calls] == list(range(len(calls)))
    assert len({c.id for c in calls}) == len(calls)
    return content, thinking, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_parses_like_one_piece(text: str) -> None:
    whole = parse([text])
    assert parse(list(text)) == whole  # one character at a time
    for i in range(len(text) + 1):  # every two-piece split
        assert parse([text[:i], text[i:]]) == whole, i
    for i in range(0, len(text), 3):  # and three pieces
        j = min(len(text), i + 7)
        assert parse([text[:i], text[i:j], text[j:]]) == whole, (i, j)


def test_an_answer_of_whitespace_streams_before_it_ends() -> None:
    # a model that only writes newlines: once they are more than could precede <think>, they are
    # content, streamed as they come rather than all at the end
    p = hermes_parser(True, True, False)
    streamed = "".join(p.feed("\n").content for _ in range(20))
    assert streamed == "\n" * 20
    # a few newlines and then <think> still open reasoning, however split
    assert parse(["\n", "\n", "<think>x</think>y"]) == ("y", "x", [])


def test_tool_call_parsed() -> None:
    content, thinking, calls = parse(["Let me check. " + CALL])
    assert content == "Let me check. " and thinking == ""
    assert calls == [("get_weather", {"city": "Paris", "unit": "C"})]


def test_two_calls_and_the_parameters_alias() -> None:
    content, _, calls = parse([TWO_CALLS])
    assert calls == [("a", {"x": 1}), ("b", {"y": [1, 2]})]
    assert content.strip() == ""


def test_without_parallel_tool_calls_only_the_first_call_is_returned() -> None:
    p = hermes_parser(False, False, True, parallel_tool_calls=False)
    out = p.feed(TWO_CALLS)
    tail = p.flush()
    assert [c.name for c in out.tool_calls + tail.tool_calls] == ["a"]
    assert [c.name for c in p.tool_calls] == ["a"]
    assert "<tool_call>" not in out.content + tail.content


def test_string_arguments_are_kept_as_they_are() -> None:
    p = hermes_parser(False, False, True)
    d = p.feed('<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>')
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("s", '{"q": 1}')]


@pytest.mark.parametrize("text", ["<tool_call>{not json}</tool_call> and text",
                                  "<tool_call>{\"arguments\": {}}</tool_call>",
                                  "<tool_call>{\"name\": 5}</tool_call>",
                                  "<tool_call>[1, 2]</tool_call>"])
def test_invalid_tool_json_falls_back_to_content(text: str) -> None:
    content, thinking, calls = parse([text])
    assert calls == [] and thinking == ""
    assert content == text


def test_unterminated_blocks_at_the_end() -> None:
    assert parse(['<tool_call>{"name": "late", "arguments": {"k": "v"}}']) == (
        "", "", [("late", {"k": "v"})])
    text = "<tool_call>{\"name\": \"broken\", "
    assert parse([text]) == (text, "", [])  # shown as written, no close tag added


def test_reasoning_and_tool_calls_together() -> None:
    content, thinking, calls = parse(["<think>I should call a tool</think>\n\n" + CALL
                                      + "\nDone."])
    assert thinking == "I should call a tool"
    assert calls == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert content == "\nDone."


def test_include_reasoning_false_drops_it() -> None:
    text = "<think>secret plan</think>\n\nanswer"
    assert parse([text], include=False) == ("answer", "", [])
    assert parse([text], include=True) == ("answer", "secret plan", [])


def test_parsing_switched_off_keeps_the_tags_as_content() -> None:
    text = "<think>x</think>" + CALL
    assert parse([text], reasoning=False, tools=False) == (text, "", [])
    content, thinking, calls = parse([text], reasoning=True, tools=False)
    assert (content, thinking, calls) == (CALL, "x", [])


def test_think_only_counts_at_the_start() -> None:
    text = "not reasoning <think>x</think> because"
    assert parse([text]) == (text, "", [])


def test_a_parser_started_inside_reasoning() -> None:
    p = hermes_parser(True, True, False, start_in_reasoning=True)
    d = p.feed("prefilled think</think>\nanswer")
    assert (d.reasoning, d.content) == ("prefilled think", "answer")


# ---- ChoiceState with the real tokenizer -------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_MODEL_ID))


def state(tokenizer, parse_tools: bool = True, reasoning: bool = True, include: bool = True,
          **options) -> ChoiceState:
    opts = OutputOptions(**options)
    return ChoiceState(0, tokenizer, tokenizer.backend_tokenizer, opts,
                       hermes_parser(reasoning, include, parse_tools),
                       TokenText(tokenizer, opts.return_tokens_as_token_ids))


def feed(st: ChoiceState, ids: list[int], chunk: int, finish: str = "stop",
         stop_reason: int | None = None, logprobs: bool = False) -> list:
    deltas = []
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        last = i + chunk >= len(ids)
        lps = tuple(TokenLogprob(t, -1.0, 1, ((t, -1.0),)) for t in part) if logprobs else None
        d = st.on_batch(TokenBatch(0, tuple(part), lps, finish if last else None,
                                   stop_reason if last else None,
                                   num_prompt_tokens=7 if i == 0 else 0))
        if d is not None:
            deltas.append(d)
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1000])
def test_tool_call_output_finishes_with_tool_calls(tokenizer, chunk: int) -> None:
    text = "<think>plan</think>\n\nSure. " + CALL
    ids = tokenizer.encode(text, add_special_tokens=False) + [IM_END]
    st = state(tokenizer)
    deltas = feed(st, ids, chunk)
    assert st.done and st.finish_reason == "tool_calls"
    assert deltas[-1].finish_reason == "tool_calls"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert st.reasoning == "plan" and st.content == "Sure. "
    assert "".join(d.content for d in deltas) == "Sure. "
    assert "".join(d.reasoning for d in deltas) == "plan"
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]
    assert st.token_ids == ids and st.num_prompt_tokens == 7


def test_length_finish_stays_length_with_tool_calls(tokenizer) -> None:
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    st = state(tokenizer)
    feed(st, ids, 4, finish="length")
    assert st.finish_reason == "length" and len(st.parser.tool_calls) == 1


def test_without_tool_parsing_the_call_is_content(tokenizer) -> None:
    ids = tokenizer.encode(CALL, add_special_tokens=False) + [IM_END]
    st = state(tokenizer, parse_tools=False)
    feed(st, ids, 3)
    assert st.finish_reason == "stop" and st.content == CALL


def test_eos_text_is_not_output_even_with_special_tokens_shown(tokenizer) -> None:
    """As vLLM: the EOS that ends generation is in token_ids, not in the text; an EOS generated
    under ignore_eos (no stop) is text like any other token."""
    ids = tokenizer.encode("hello", add_special_tokens=False)
    st = state(tokenizer, skip_special_tokens=False)
    feed(st, ids + [IM_END], 1)
    assert st.content == "hello" and st.token_ids == ids + [IM_END]
    kept = state(tokenizer, skip_special_tokens=False, include_stop_str_in_output=True)
    feed(kept, ids + [IM_END], 1)
    assert kept.content == "hello <|im_end|>"  # spaces_between_special_tokens defaults on
    shown = state(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False)
    feed(shown, ids + [IM_END, IM_END], 1, finish="length")
    assert shown.content == "hello<|im_end|><|im_end|>"


def test_stop_token_id_text_is_cut_and_reported(tokenizer) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    st = state(tokenizer)
    deltas = feed(st, ids, 2, stop_reason=ids[-1])
    assert st.finish_reason == "stop" and st.stop_reason == ids[-1]
    assert st.content == tokenizer.decode(ids[:-1])
    assert deltas[-1].stop_reason == ids[-1] and deltas[-1].token_ids[-1] == ids[-1]
    kept = state(tokenizer, include_stop_str_in_output=True)
    feed(kept, ids, 2, stop_reason=ids[-1])
    assert kept.content == "one two three"


def test_stop_string_ends_the_choice_and_later_batches_are_ignored(tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    st = state(tokenizer, stop=(" gam",))
    deltas = feed(st, ids, 1, finish="length")
    assert st.content == "alpha beta" and st.finish_reason == "stop" and st.stop_reason == " gam"
    assert deltas[-1].finish_reason == "stop"
    assert st.on_batch(TokenBatch(0, (5,))) is None


def test_logprob_bytes_join_into_the_text(tokenizer) -> None:
    """A token that ends inside a character reads as U+FFFD, but its bytes are its own."""
    text = "日本語 😀 中文字符 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    st = state(tokenizer, logprobs=True, top_logprobs=1)
    feed(st, ids, 1, finish="length", logprobs=True)
    assert st.content == text
    assert any("\ufffd" in e.token for e in st.logprobs)
    assert b"".join(bytes(e.bytes) for e in st.logprobs).decode("utf-8") == text
    assert all(e.top_logprobs[0].bytes == e.bytes for e in st.logprobs)
    as_ids = TokenText(tokenizer, True)
    assert as_ids(ids[0]) == f"token_id:{ids[0]}"
    assert bytes(as_ids.token_bytes(ids[0])) == f"token_id:{ids[0]}".encode()
    assert TokenText(tokenizer, False).token_bytes(IM_END) == list(b"<|im_end|>")


def test_score_is_mean_logprob_under_length_penalty(tokenizer) -> None:
    st = state(tokenizer)
    lps = (TokenLogprob(5, -1.0, 1), TokenLogprob(6, -3.0, 2))
    st.on_batch(TokenBatch(0, (5, 6), lps, "length"))
    assert st.score(1.0) == pytest.approx(-2.0)
    assert st.score(0.0) == pytest.approx(-4.0)
