"""Tool-call and reasoning parsers per model family (serve_app/tool_formats.py,
serve_app/reasoning_formats.py, serve_app/tool_parser.py) against each family's real chat
template (tests/data/chat_templates/): the template is detected as its family, what the template
itself writes for an assistant's tool call parses back to that call, text written the way the
family writes it parses the same streamed in random splits as whole, and the calls parsed go
back through the template (ids included) for the next turn."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from serve_app import reasoning_formats, tool_formats
from serve_app.tool_parser import OutputParser

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "number"}}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ARGS = {"city": "Paris, \"FR\" <1>", "days": 3, "metric": True, "hours": [9, 12.5]}
USER = {"role": "user", "content": "Weather in Paris?"}


@dataclass(frozen=True)
class Family:
    template: str
    tools: str
    reasoning: str | None
    # outputs written the way the family writes them, and the calls in each
    outputs: tuple[tuple[str, list[tuple[str, dict]]], ...]
    end_tokens: tuple[str, ...]  # what ends an assistant turn in the template
    content_before_calls: str = ""  # what the model says before its calls, if anything


DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
      "<｜tool▁calls▁end｜>")


def _ds_call(name: str, args: dict) -> str:
    return f"{DS[1]}function{DS[2]}{name}\n```json\n{json.dumps(args)}\n```{DS[3]}"


FAMILIES = {
    "hermes-qwen3": Family(
        "Qwen-Qwen3-0.6B.jinja", "hermes", "qwen3",
        (("<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n"
          + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>\n"
          "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {"zone": "CET"}})
          + "\n</tool_call>", [("get_weather", ARGS), ("get_time", {"zone": "CET"})]),),
        ("<|im_end|>",)),
    "hermes-3": Family(
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", None,
        (("<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}})
          + "\n</tool_call>", [("get_time", {"zone": "UTC"})]),), ("<|im_end|>",)),
    "llama3_json": Family(
        "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", None,
        ((json.dumps({"name": "get_weather", "parameters": ARGS}), [("get_weather", ARGS)]),
         ("<|python_tag|>" + json.dumps({"name": "get_time", "parameters": {"zone": "UTC"}})
          + "; " + json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}}),
          [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
         ("The answer is {not a call}.", [])),
        ("<|eot_id|>",)),
    "mistral": Family(
        "mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", None,
        (("[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": ARGS},
                                        {"name": "get_time", "arguments": {"zone": "CET"}}]),
          [("get_weather", ARGS), ("get_time", {"zone": "CET"})]),
         ("[TOOL_CALLS]get_time[ARGS]" + json.dumps({"zone": "UTC"}), [("get_time",
                                                                          {"zone": "UTC"})])),
        ("</s>",)),
    "qwen3_coder": Family(
        "Qwen3-Coder.jinja", "qwen3_coder", None,
        (("I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
          'Paris, "FR" <1>\n</parameter>\n<parameter=days>\n3\n</parameter>\n'
          "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12.5]\n"
          "</parameter>\n</function>\n</tool_call>", [("get_weather", ARGS)]),),
        ("<|im_end|>",)),
    "deepseek": Family(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3", "deepseek_r1",
        (("Weather needs a tool.\n</think>\n\n" + DS[0] + _ds_call("get_weather", ARGS)
          + _ds_call("get_time", {"zone": "CET"}) + DS[4],
          [("get_weather", ARGS), ("get_time", {"zone": "CET"})]),),
        ("<｜end▁of▁sentence｜>",)),
}


def template(family: Family) -> str:
    return (TEMPLATES / family.template).read_text()


def render(family: Family, messages: list[dict], **kwargs) -> str:
    texts, _ = render_jinja_template(
        conversations=[messages], tools=TOOLS, chat_template=template(family),
        bos_token="<s>", eos_token="</s>", **kwargs)
    return texts[0]


def parse(family: Family, pieces: list[str], start_in_reasoning: bool = False,
          ) -> tuple[str, str, list[tuple[str, dict]], list[str]]:
    fmt = tool_formats.FORMATS[family.tools]
    reasoning = reasoning_formats.FORMATS[family.reasoning] if family.reasoning else None
    p = OutputParser(reasoning, True, fmt, start_in_reasoning=start_in_reasoning,
                     schemas=SCHEMAS)
    content, thinking, calls = "", "", []
    for piece in [*pieces, None]:
        d = p.feed(piece) if piece is not None else p.flush()
        content, thinking, calls = content + d.content, thinking + d.reasoning, calls + d.tool_calls
    return (content, thinking, [(c.name, json.loads(c.arguments)) for c in calls],
            [c.id for c in calls])


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_template_is_detected_as_its_family(name: str) -> None:
    family = FAMILIES[name]
    assert tool_formats.detect(template(family)).name == family.tools
    found = reasoning_formats.detect(template(family), has_think_tokens=False)
    assert (found.name if found else None) == family.reasoning


@pytest.mark.parametrize("name", FAMILIES)
def test_what_the_template_writes_for_a_call_parses_back(name: str) -> None:
    """The assistant's tool-call turn as the family's own template writes it, fed to the parser
    as the model's output: the same call comes back, with no content."""
    family = FAMILIES[name]
    call = {"id": "abcDEF123", "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS}}
    prompt = render(family, [USER], add_generation_prompt=True)
    full = render(family, [USER, {"role": "assistant", "content": "", "tool_calls": [call]}])
    # the turn starts where the history leaves the generation prompt (which may also open a
    # reasoning block that the history's form of the turn leaves out)
    common = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), len(prompt))
    common -= full[common - 1] == "<"  # (both went on with a tag)
    written = full[common:]
    for end in family.end_tokens:
        written = written.split(end)[0]
    assert len(written) > 20, (prompt, full)
    content, _, calls, _ = parse(family, [written])
    assert calls == [("get_weather", ARGS)], written
    assert content.strip() == "", written


@pytest.mark.parametrize("name", FAMILIES)
def test_outputs_parse_the_same_streamed_in_random_splits(name: str) -> None:
    family = FAMILIES[name]
    rng = random.Random(name)
    prompt = render(family, [USER], add_generation_prompt=True)
    in_reasoning = reasoning_formats.starts_in_reasoning(
        reasoning_formats.FORMATS[family.reasoning] if family.reasoning else None, prompt)
    for output, want in family.outputs:
        whole = parse(family, [output], in_reasoning)
        assert whole[2] == want, output
        if not want:
            assert whole[0] == output  # not calls: all content, as written
        for _ in range(25):
            assert parse(family, splits(output, rng), in_reasoning)[:3] == whole[:3]


@pytest.mark.parametrize("name", FAMILIES)
def test_parsed_calls_go_back_through_the_template(name: str) -> None:
    """The next turn: the calls as the API returned them (ids, arguments as JSON text turned
    back into objects, as clients send them to HF templates) and the tool's result render."""
    family = FAMILIES[name]
    output, want = family.outputs[0]
    _, _, calls, ids = parse(family, [output], family.reasoning == "deepseek_r1")
    if family.tools == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    first = {"id": ids[0], "type": "function",
             "function": {"name": calls[0][0], "arguments": calls[0][1]}}
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": [first]},
                {"role": "tool", "tool_call_id": ids[0], "name": calls[0][0],
                 "content": "sunny"}]
    text = render(family, messages, add_generation_prompt=True)
    assert "sunny" in text and calls[0][0] in text


def test_qwen3_coder_values_follow_the_schema_and_stay_text_without_one() -> None:
    fmt = tool_formats.FORMATS["qwen3_coder"]
    section = ("\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
               "<parameter=days>\nsoon\n</parameter>\n<parameter=extra>\n{\"a\": 1}\n"
               "</parameter>\n</function>\n")
    calls = fmt.parse(section, SCHEMAS)
    assert calls is not None
    # a string stays a string even when it looks like a number; a value its type cannot
    # read stays text; a parameter the schema does not know stays text
    assert json.loads(calls[0][1]) == {"city": "42", "days": "soon", "extra": '{"a": 1}'}


def test_deepseek_r1_reasoning_without_an_opening_tag() -> None:
    """R1 starts inside its reasoning (its template opens <think> in the prompt, older ones
    did not); with thinking closed by the prompt, the answer is content."""
    r1 = reasoning_formats.FORMATS["deepseek_r1"]
    assert reasoning_formats.starts_in_reasoning(r1, "<｜User｜>hi<｜Assistant｜>")
    assert reasoning_formats.starts_in_reasoning(r1, "<｜User｜>hi<｜Assistant｜><think>\n")
    assert not reasoning_formats.starts_in_reasoning(
        r1, "<｜User｜>hi<｜Assistant｜><think>\n</think>")
    qwen3 = reasoning_formats.FORMATS["qwen3"]
    assert not reasoning_formats.starts_in_reasoning(qwen3, "<|im_start|>assistant\n")
    p = OutputParser(r1, True, None, start_in_reasoning=True)
    out = [p.feed(x) for x in ("<th", "ink>\nplan", "</think>\n\nanswer")] + [p.flush()]
    assert "".join(d.reasoning for d in out) == "\nplan"
    assert "".join(d.content for d in out) == "answer"


def test_llama3_json_only_where_the_answer_begins() -> None:
    family = FAMILIES["llama3_json"]
    text = 'Call it like {"name": "get_time", "parameters": {}} if you want.'
    assert parse(family, [text]) == (text, "", [], [])
    content, _, calls, _ = parse(family, ["  \n", '{"name": "get_time", "parameters": {}}'])
    assert calls == [("get_time", {})] and content == ""


# ---- tool_choice required / named: the family's syntax, enforced ------------------------------
PLAIN_ARGS = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 12.5]}
TIME_ARGS = {"zone": "CET"}


def _coder_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{json.dumps(v) if not isinstance(v, str) else v}\n"
                     "</parameter>\n".replace("True", "true") for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _canonical(family: str, calls: list[tuple[str, dict]]) -> str:
    """Calls written exactly as the family writes them (its template's form)."""
    if family == "hermes":
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a})
                         + "\n</tool_call>" for n, a in calls)
    if family == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if family == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if family == "deepseek_v3":
        return DS[0] + "".join(_ds_call(n, a) for n, a in calls) + DS[4]
    return "\n".join(_coder_call(n, a) for n, a in calls)


@pytest.fixture(scope="module")
def compile_grammar():
    from tokenizers import Tokenizer

    from replicas.embedded import EMBEDDED_MODEL_ID
    from replicas.model_files import resolve_model_path
    from structured.compiler import Compiler
    from structured.vocabulary import Vocabulary
    tok = Tokenizer.from_file(str(resolve_model_path(EMBEDDED_MODEL_ID) / "tokenizer.json"))
    vocab = Vocabulary.from_tokenizer(tok, [tok.token_to_id("<|im_end|>")],
                                      tok.get_vocab_size())
    compiler = Compiler(vocab, timeout_s=30.0, processes=1)

    def accepts(grammar: str, text: str) -> bool:
        from structured.spec import Constraint
        from tests.structured.structured_testing import accepts as accepted
        compiled = asyncio.run(compiler.compile(Constraint("grammar", grammar)))
        return accepted(compiled, tok, text)
    yield accepts
    compiler.close()


@pytest.mark.parametrize("family", list(tool_formats.FORMATS))
def test_forced_choices_take_the_familys_own_syntax(family: str, compile_grammar) -> None:
    """The grammar of tool_choice required (several calls or one) and named accepts the calls
    as the family writes them and nothing else; the auto parser reads them back."""
    fmt = tool_formats.FORMATS[family]
    tools = [(n, SCHEMAS[n]) for n in ("get_weather", "get_time")]
    two = [("get_weather", PLAIN_ARGS), ("get_time", TIME_ARGS)]
    both = _canonical(family, two)
    assert compile_grammar(fmt.grammar(tools, True), both)
    assert not compile_grammar(fmt.grammar(tools, False), both)  # parallel_tool_calls false
    one = _canonical(family, two[1:])
    assert compile_grammar(fmt.grammar(tools, False), one)
    assert compile_grammar(fmt.grammar(tools[1:], False), one)  # named: get_time
    assert not compile_grammar(fmt.grammar(tools[:1], False), one)  # named: get_weather
    bad = _canonical(family, [("get_weather", {**PLAIN_ARGS, "days": "three"})])
    assert not compile_grammar(fmt.grammar(tools, True), bad)
    p = OutputParser(None, False, fmt, schemas=SCHEMAS)
    out = [p.feed(both), p.flush()]
    assert [(c.name, json.loads(c.arguments)) for d in out for c in d.tool_calls] == two
    assert "".join(d.content for d in out) == ""


def test_the_flags_choose_the_parsers_else_the_template_does() -> None:
    """--tool-call-parser / --reasoning-parser reach the served model's formats; without them
    the chat template decides (the tiny test model's is Qwen-style: hermes, qwen3)."""
    import argparse

    from serve_app import cli
    from serve_app.models import load_model

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "shardserve/tiny-llama",
                              "--tool-call-parser", "mistral", "--reasoning-parser", "none"])
    model = cli.config_from_args(args).models[0]
    served = load_model(model, handle=None)
    assert served.tool_format.name == "mistral" and served.reasoning_format is None
    detected = load_model(model.model_copy(update={"tool_call_parser": None,
                                                   "reasoning_parser": None}), handle=None)
    assert detected.tool_format.name == "hermes"
    assert detected.reasoning_format is not None and detected.reasoning_format.name == "qwen3"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "pythonic"])
