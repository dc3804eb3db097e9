"""Guides accept valid outputs and refuse invalid ones, token by token through the mask, for every
constraint kind; schema keywords are enforced (an out-of-bound value is refused)."""

from __future__ import annotations

import json

import pytest

from structured import bitmask
from structured.errors import InvalidTokenError
from structured.spec import Constraint
from tests.structured.structured_testing import accepts, allowed, encode, feed, schema


async def judge(compiler, tokenizer, spec, valid, invalid):
    compiled = await compiler.compile(spec)
    for text in valid:
        assert accepts(compiled, tokenizer, text), f"refused valid {text!r}"
    for text in invalid:
        assert not accepts(compiled, tokenizer, text), f"accepted invalid {text!r}"
    return compiled


async def test_regex(compiler, tokenizer):
    compiled = await judge(compiler, tokenizer, Constraint("regex", r"\d{3}-\d{4}( ext\. \d+)?"),
                           ["555-1234", "555-1234 ext. 42"],
                           ["555-123", "5551234", "555-1234 ext.", "555-12345", ""])
    assert compiled.backend == "outlines"


async def test_regex_continues_after_a_possible_end(compiler, tokenizer):
    # outlines-core 0.2.14 alone drops "." after "12" here; the sentinel compile keeps it.
    await judge(compiler, tokenizer, Constraint("regex", r"[0-9]+(\.[0-9]+)?"),
                ["12", "12.5", "3.14159"], ["12.", ".5", "1a"])
    await judge(compiler, tokenizer, Constraint("regex", r"(ac|[^a])+"), ["acac", "xacy"], ["a"])


async def test_regex_unicode(compiler, tokenizer, fallback_compiler, fallback_tokenizer):
    spec = Constraint("regex", r"[^\n]{1,20}")
    await judge(compiler, tokenizer, spec, ["日本 😀 Ɣ"], ["a\nb"])
    await judge(fallback_compiler, fallback_tokenizer, spec, ["日本 😀 Ɣ"], ["a\nb"])


async def test_choice(compiler, tokenizer):
    await judge(compiler, tokenizer, Constraint("choice", json.dumps(["yes", "no", "日本", "a.b"])),
                ["yes", "no", "日本", "a.b"], ["ye", "yes!", "maybe", "axb", "Yes"])


async def test_json_object(compiler, tokenizer):
    compiled = await judge(compiler, tokenizer, Constraint("json_object", ""),
                           ['{"a": [1, 2.5, null, "日本"], "b": {"c": true}}', "{}"],
                           ["[1]", '"x"', '{"a": }', '{"a": 1'])
    assert compiled.backend == "llguidance"


async def test_lark_grammar(compiler, tokenizer):
    lark = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
    await judge(compiler, tokenizer, Constraint("grammar", lark),
                ["1+2", "(1-2)+30", "7"], ["1+", "(1", "1*2", ""])


async def test_gbnf_grammar(compiler, tokenizer):
    gbnf = 'root ::= "yes" | "no" | item+\nitem ::= [a-c] ","'
    await judge(compiler, tokenizer, Constraint("grammar", gbnf),
                ["yes", "no", "a,b,", "c,"], ["maybe", "a,b", "d,"])


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("s, valid, invalid", [
    ({"type": "integer", "minimum": 0, "maximum": 150}, [0, 42, 150], [-1, 151, 1000, 1.5]),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, [0.5], [0, 1, 2]),
    ({"type": "integer", "multipleOf": 5}, [0, 15], [7]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "日本語"], ["a", "abcd"]),
    ({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, ["ab-12"], ["ab-1", "AB-12"]),
    ({"type": "string", "format": "date"}, ["2024-02-29"], ["2024-13-01", "yesterday"]),
    ({"enum": ["red", 1, None]}, ["red", 1, None], ["blue", 2]),
    ({"const": {"a": [1, 2]}}, [{"a": [1, 2]}], [{"a": [1]}]),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, [3, "ab"],
     ["abc", 1.5]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [3, "x"], [True]),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, [3], [2]),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/pos"}}, "required": ["p"],
      "$defs": {"pos": {"type": "integer", "minimum": 1}}}, [{"p": 1}], [{"p": 0}, {}]),
    ({"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}},
      "additionalProperties": False},
     # properties come in schema order (llguidance fixes the order)
     [{"next": {"next": {"next": {"next": {"v": 5}, "v": 4}, "v": 3}, "v": 2}, "v": 1}],
     [{"next": {"next": {"next": {"next": {"v": "x"}}}}}]),
    ({**PERSON, "additionalProperties": False}, [{"name": "Ada", "age": 36}],
     [{"name": "Ada", "age": 36, "x": 1}, {"name": "Ada"}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{"a": 1}], [{"a": "x"}]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [[1], [1, 2]],
     [[], [1, 2, 3], ["a"]]),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, [["a"]], [["a", 1]]),
])
async def test_schema_keywords_enforced(compiler, tokenizer, s, valid, invalid):
    dump = lambda x: json.dumps(x, ensure_ascii=False)
    await judge(compiler, tokenizer, schema(s), [dump(v) for v in valid], [dump(v) for v in invalid])


async def test_json_whitespace_is_bounded(compiler, tokenizer):
    await judge(compiler, tokenizer, schema(PERSON),
                ['{"name": "Ada", "age": 36}', '{"name":"Ada","age":36}',
                 '{ "name" : "Ada" , "age" : 36 }'],
                ['{"name":  "Ada", "age": 36}', '{\n"name": "Ada", "age": 36}',
                 ' {"name": "Ada", "age": 36}'])
    await judge(compiler, tokenizer, schema(PERSON, disable_any_whitespace=True),
                ['{"name":"Ada","age":36}'], ['{"name": "Ada","age":36}'])
    await judge(compiler, tokenizer, schema(PERSON, whitespace_pattern=r"[\n ]{0,4}"),
                ['{\n  "name": "Ada",\n  "age": 36\n}'], ['{\n\n\n\n\n"name": "Ada", "age": 36}'])


async def test_disable_additional_properties(compiler, tokenizer):
    extra = '{"name": "Ada", "age": 36, "x": 1}'
    await judge(compiler, tokenizer, schema(PERSON), [extra], [])
    await judge(compiler, tokenizer, schema(PERSON, disable_additional_properties=True),
                ['{"name": "Ada", "age": 36}'], [extra])


async def test_structural_tag(compiler, tokenizer):
    tag = {"structures": [{"begin": "<tool_call>", "schema": PERSON, "end": "</tool_call>"}],
           "triggers": ["<tool_call>"]}
    await judge(compiler, tokenizer, Constraint("structural_tag", json.dumps(tag)),
                ['Hi <tool_call>{"name": "Ada", "age": 36}</tool_call>', "just text"],
                ['<tool_call>{"name": "Ada"}</tool_call>'])


async def test_forced_tokens_jump_forward(compiler, tokenizer, vocab):
    fixed = {"type": "object", "properties": {"kind": {"const": "person"}, "name": {"type": "string"}},
             "required": ["kind", "name"]}
    guide = (await compiler.compile(schema(fixed, disable_any_whitespace=True))).new_guide()
    forced = guide.forced_tokens()
    text = b"".join(vocab.token_bytes[t] for t in forced).decode()
    assert len(forced) >= 2 and '{"kind":"person","name":"'.startswith(text)
    assert guide.forced_tokens() == forced  # computing them does not advance
    guide.advance_many(forced)
    rest = '{"kind":"person","name":"Ada"}'[len(text):]
    assert feed(guide, encode(tokenizer, rest))

    # outlines-core: a token is forced when it is the only one allowed (a BEL byte merges with nothing)
    regex = (await compiler.compile(Constraint("regex", r"\x07\x07[0-9]"))).new_guide()
    forced = regex.forced_tokens()
    assert b"".join(vocab.token_bytes[t] for t in forced) == b"\x07\x07"
    assert regex.forced_tokens(max_tokens=1) == forced[:1]
    regex.advance_many(forced)
    assert regex.forced_tokens() == [] and not regex.is_finished()


async def test_eos_and_invalid_tokens(compiler, tokenizer, vocab):
    compiled = await compiler.compile(Constraint("choice", json.dumps(["yes", "no"])))
    for kind_compiled in (compiled, await compiler.compile(schema({"enum": ["yes", "no"]}))):
        guide = kind_compiled.new_guide()
        with pytest.raises(InvalidTokenError):
            guide.advance(vocab.eos_token_id)  # EOS before the output is complete
        guide = kind_compiled.new_guide()
        with pytest.raises(InvalidTokenError):
            guide.advance(encode(tokenizer, "maybe")[0])
    guide = compiled.new_guide()
    guide.advance_many(encode(tokenizer, "yes"))
    assert guide.is_finished() and guide.can_only_finish()
    mask = bitmask.allocate(2, vocab.size)
    guide.fill_bitmask(mask, 0)
    assert all(allowed(mask[0], e) for e in vocab.eos_token_ids)  # every EOS id, not just one
    guide.advance(vocab.eos_token_ids[1])  # robust: EOS ends the output, state unchanged
    assert guide.ended and guide.is_finished()
    guide.fill_bitmask(mask, 1)
    assert [i for i in range(vocab.size) if allowed(mask[1], i)] == sorted(vocab.eos_token_ids)
    with pytest.raises(InvalidTokenError):
        guide.advance(encode(tokenizer, "y")[0])


async def test_final_state_need_not_stop(compiler, tokenizer):
    guide = (await compiler.compile(Constraint("regex", r"[0-9]+"))).new_guide()
    guide.advance_many(encode(tokenizer, "1"))
    assert guide.is_finished() and not guide.can_only_finish()


async def test_fill_bitmask_checks_layout(compiler, vocab):
    import torch

    guide = (await compiler.compile(Constraint("json_object", ""))).new_guide()
    with pytest.raises(ValueError):
        guide.fill_bitmask(torch.zeros(1, vocab.bitmask_words + 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError):
        guide.fill_bitmask(torch.zeros(1, vocab.bitmask_words, dtype=torch.int64), 0)
    with pytest.raises(IndexError):
        guide.fill_bitmask(bitmask.allocate(1, vocab.size), 1)
