"""The ingress check: invalid or unenforceable constraints are a 400 that names the problem; nothing
is ignored silently."""

from __future__ import annotations

import json

import pytest

from structured.errors import ConstraintError
from structured.schema_check import check_constraint
from structured.spec import Constraint
from tests.structured.structured_testing import schema


def rejected(spec: Constraint) -> ConstraintError:
    with pytest.raises(ConstraintError) as info:
        check_constraint(spec)
    return info.value


@pytest.mark.parametrize("s, keyword", [
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "array", "contains": {"type": "string"}}, "contains"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "format": "url"}, "format"),
    ({"type": "object", "properties": {"a": {"type": "integer", "divisibleBy": 3}}}, "divisibleBy"),
    ({"type": "array", "prefixItems": [{}], "additionalItems": False}, "additionalItems"),
    ({"type": "object", "properties": {"a": {"not": {}}}}, "not"),  # nested too
])
def test_unenforced_keywords_are_named(s, keyword):
    error = rejected(schema(s))
    assert keyword in error.message and error.param == "response_format"
    assert error.status_code == 400


@pytest.mark.parametrize("value", ["{not json", json.dumps([1, 2]), json.dumps(False)])
def test_not_a_schema(value):
    rejected(Constraint("json_schema", value))


def test_meta_validation():
    error = rejected(schema({"type": "object", "properties": {"a": {"type": "strin"}}}))
    assert "properties/a/type" in error.message
    rejected(schema({"type": "integer", "minimum": "3"}))
    rejected(schema({"$schema": "http://json-schema.org/draft-03/schema#", "type": "string"}))


def test_unsatisfiable_and_remote_refs():
    assert "minimum" in rejected(schema({"type": "integer", "minimum": 5, "maximum": 1})).message
    rejected(schema({"$ref": "https://example.com/schema.json"}))


def test_supported_schema_passes_with_llguidance():
    plan = check_constraint(schema({"type": "object", "properties": {"a": {"type": "integer",
                                                                          "minimum": 1}}}))
    assert plan.backend == "llguidance"
    assert check_constraint(Constraint("json_object", "")).backend == "llguidance"
    assert check_constraint(schema(True)).backend == "llguidance"


@pytest.mark.parametrize("rx, why", [
    (r"(?=abc)abc", "look-around"),
    (r"abc(?!d)", "look-around"),
    (r"(?<=a)b", "look-around"),
    (r"(?<!a)b", "look-around"),
    (r"(a)\1", "back-reference"),
    (r"(?<n>a)\k<n>", "back-reference"),
    (r"^abc", "leading '^'"),
    (r"(^abc)", "leading '^'"),
    (r"\Aabc", "leading '^'"),
    (r"a{2,1}", "invalid regex"),
    (r"[a-", "invalid regex"),
    (r"\bword\b", "invalid regex"),
])
def test_regex_refusals(rx, why):
    error = rejected(Constraint("regex", rx))
    assert why in error.message and error.param == "regex"


@pytest.mark.parametrize("rx", [r"\(?=a\)", r"[(?=]+", r"[]^]x", r"a\^b", r"(?<name>a)b", r"a\$",
                                r"[[a-z]&&[^b]]", r"x\\"])
def test_regex_lookalikes_pass(rx):
    plan = check_constraint(Constraint("regex", rx))
    assert plan.backend == "outlines" and plan.source == rx


@pytest.mark.parametrize("rx, source", [(r"x\d{3}$", r"x\d{3}"), (r"ab\z", "ab"), (r"a\\$", r"a\\")])
def test_trailing_end_anchor_is_dropped(rx, source):
    assert check_constraint(Constraint("regex", rx)).source == source


def test_choice():
    plan = check_constraint(Constraint("choice", json.dumps(["a.b", "c|d", "(x)", "日本"])))
    assert plan.backend == "outlines" and plan.source == r"(a\.b|c\|d|\(x\)|日本)"
    for bad in ["[]", '["a", 1]', "nope", '[""]']:
        assert rejected(Constraint("choice", bad)).param == "choice"


def test_grammar_errors():
    assert rejected(Constraint("grammar", "start: undefined_rule")).param == "grammar"
    assert check_constraint(Constraint("grammar", 'start: "a"+')).backend == "llguidance"
    assert check_constraint(Constraint("grammar", 'root ::= "a" [0-9]+')).backend == "llguidance"


def test_structural_tag_checks():
    bad = {"structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>"}], "triggers": ["<g"]}
    assert rejected(Constraint("structural_tag", json.dumps(bad))).param == "structural_tag"
    worse = {"structures": [{"begin": "<f=a>", "schema": {"not": {}}, "end": "</f>"}],
             "triggers": ["<f="]}
    assert "not" in rejected(Constraint("structural_tag", json.dumps(worse))).message


def test_whitespace_pattern_errors_are_400():
    rejected(schema({"type": "object"}, whitespace_pattern="[ "))


def test_error_envelope():
    error = ConstraintError("nope", "regex")
    assert error.to_dict() == {"message": "nope", "type": "invalid_request_error",
                               "param": "regex", "code": 400}
