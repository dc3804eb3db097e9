"""Cheap validation of a constraint, and the choice of the backend that will enforce it.

`check_constraint(spec)` runs in the ingress (milliseconds, no vocabulary) and again in the compiler.
It raises `ConstraintError` (HTTP 400) for anything the server would not enforce exactly: it never
ignores a keyword silently. It returns a `Plan`: which backend compiles the constraint and from
what source text.

Backends (measured on JSONSchemaBench, see benchmarks/structured_coverage.py):
  llguidance    json_schema, json_object, grammar (Lark or GBNF), structural_tag. Its JSON-schema
                compiler enforces numeric bounds, lengths, patterns, formats, sibling keywords,
                additionalProperties, $ref recursion... and reports every keyword it does not
                implement (not, if/then/else, contains, uniqueItems, dependencies, overlapping oneOf,
                unknown formats) as an error instead of dropping it; it compiles in milliseconds.
                On a 78-schema sample, llguidance passed 66 and accepted no invalid instance;
                outlines-core's schema-to-regex passed 45, accepted invalid instances on 11 (keywords
                dropped silently) and took over 5 s on 3.
  outlines      regex and choice: a precomputed token automaton whose per-token mask is 5-30x
                faster than llguidance's on regexes (1-5 µs on our 4k vocabulary); compiling a wide
                regex can take minutes, which the compiler bounds by killing the worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

import jsonschema
import llguidance
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from structured.errors import ConstraintError
from structured.spec import Constraint

Backend = Literal["outlines", "llguidance"]

# At most one space wherever JSON allows whitespace: a model cannot run away in newlines.
DEFAULT_JSON_WHITESPACE = r"[ ]?"

# Draft-3 keywords that draft-4+ validators ignore and llguidance does too: a user who writes them
# means them, so they are refused rather than dropped.
_LEGACY_KEYWORDS = ("divisibleBy", "disallow", "extends")

# Keywords whose value is a subschema / a list of subschemas / a map of subschemas.
_SUBSCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "not", "if", "then",
              "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                  "dependencies")


@dataclass(frozen=True)
class Plan:
    """How a checked constraint is compiled: `source` is a regex (outlines) or an llguidance
    grammar (llguidance). `param` is the request field blamed for compile errors."""

    backend: Backend
    source: str
    param: str


# the one backend that compiles each kind (no fallback between them)
BACKEND_OF_KIND: dict[str, Backend] = {
    "json_schema": "llguidance", "json_object": "llguidance", "grammar": "llguidance",
    "structural_tag": "llguidance", "regex": "outlines", "choice": "outlines"}


def check_constraint(spec: Constraint) -> Plan:
    """Validate `spec` and choose its backend. Raises ConstraintError (400) when it is invalid or
    uses something the backend would not enforce."""
    if spec.kind == "json_schema":
        return Plan("llguidance", _json_grammar(_load_schema(spec.value), spec), "response_format")
    if spec.kind == "json_object":  # any object: nothing to close
        any_object = replace(spec, disable_additional_properties=False)
        return Plan("llguidance", _json_grammar({"type": "object"}, any_object), "response_format")
    if spec.kind == "regex":
        return Plan("outlines", check_regex(spec.value), "regex")
    if spec.kind == "choice":
        return Plan("outlines", choice_regex(spec.value), "choice")
    if spec.kind == "grammar":
        return Plan("llguidance", _grammar(spec.value), "grammar")
    if spec.kind == "structural_tag":
        return Plan("llguidance", _structural_tag(spec), "structural_tag")
    raise ConstraintError(f"unknown constraint kind {spec.kind!r}", "response_format")


# ---- JSON schema --------------------------------------------------------------------------------

def _load_schema(text: str, param: str = "response_format") -> dict[str, Any]:
    """The schema as a dict, meta-validated against its draft (default 2020-12)."""
    try:
        schema = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the JSON schema is not valid JSON: {e}", param) from None
    if schema is True:
        return {}
    if schema is False:
        raise ConstraintError("the JSON schema `false` accepts nothing", param)
    if not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be an object", param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if validator is jsonschema.Draft3Validator:
        raise ConstraintError("JSON schema draft 3 is not supported; use draft 4 or later", param)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ConstraintError(f"invalid JSON schema at '/{where}': {e.message}", param) from None
    try:
        _refuse_unenforced(schema, "")
    except ConstraintError as e:
        e.param = param
        raise
    return schema


def _refuse_unenforced(node: Any, where: str) -> None:
    """Walk every subschema; refuse keywords that validators (and llguidance) would drop."""
    if not isinstance(node, dict):
        return
    for keyword in _LEGACY_KEYWORDS:
        if keyword in node:
            raise ConstraintError(
                f"JSON schema keyword '{keyword}' (draft 3) at '{where or '/'}' is not supported")
    if isinstance(node.get("required"), bool):
        raise ConstraintError(
            f"boolean 'required' (draft 3) at '{where or '/'}' is not supported; list the "
            "required properties in the object's 'required' array")
    if "additionalItems" in node and "prefixItems" in node:  # draft 2020-12 validators ignore it
        raise ConstraintError(
            f"JSON schema keyword 'additionalItems' at '{where or '/'}' does not apply to "
            "'prefixItems'; use 'items' for the items after them")
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            _refuse_unenforced(node[key], f"{where}/{key}")
    for key in _SUBSCHEMA_LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _refuse_unenforced(sub, f"{where}/{key}/{i}")
    for key in _SUBSCHEMA_MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _refuse_unenforced(sub, f"{where}/{key}/{name}")


def _close_objects(node: Any) -> Any:
    """A copy of the schema where objects that do not say otherwise get additionalProperties: false."""
    if isinstance(node, list):
        return [_close_objects(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = ({k: _close_objects(v) for k, v in value.items()}
                        if isinstance(value, dict) else value)
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value
        else:
            out[key] = _close_objects(value)
    types = node.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or (
        "properties" in node)
    if is_object and "additionalProperties" not in node and "patternProperties" not in node:
        out["additionalProperties"] = False
    return out


def json_options(spec: Constraint) -> dict[str, Any]:
    """llguidance JSON compile options for the spec's whitespace settings; never lenient."""
    options: dict[str, Any] = {"lenient": False, "coerce_one_of": False,
                               "json_allow_general_unicode_escapes": True}
    if spec.disable_any_whitespace:
        options["whitespace_flexible"] = False
    else:
        options["whitespace_pattern"] = (DEFAULT_JSON_WHITESPACE if spec.whitespace_pattern is None
                                         else spec.whitespace_pattern)
    return options


def _json_grammar(schema: dict[str, Any], spec: Constraint) -> str:
    schema = dict(schema)
    if spec.disable_additional_properties:
        schema = _close_objects(schema)
    # options come from the request, never from inside the user's schema
    schema["x-guidance"] = json_options(spec)
    grammar = _lark("start: %json " + json.dumps(schema))
    _validate(grammar, "response_format", _explain_json_error)
    return grammar


# Every llguidance grammar is built with `no_forcing`: by default, where the grammar forces some
# bytes, llguidance's mask offers only the canonical tokenization of those bytes taken alone, which
# refuses the tokenization a model would write in context (`"North` is N|ort|h after `","`, but
# only "or" is offered after N). With no_forcing the mask is exactly the set of tokens that keep the
# output valid (on JSONSchemaBench: 0 mis-judged instead of 1, and masks 2x faster on our 4k
# vocabulary), and compute_ff_tokens() still gives the forced tokens for jump-forward decoding.
_NO_FORCING = '%llguidance {"no_forcing": true}\n'


def _lark(text: str) -> str:
    return LLMatcher.grammar_from_lark(_NO_FORCING + text)


def _explain_json_error(message: str) -> str:
    if "failed to compile JSON schema: " in message:  # drop the position in our wrapper grammar
        message = message.split("failed to compile JSON schema: ", 1)[1]
    if "Unimplemented keys:" in message:
        keys = _rest_of_line(message.split("Unimplemented keys:", 1)[1])
        try:
            names = ", ".join(f"'{k}'" for k in json.loads(keys))
        except ValueError:
            names = keys
        return f"JSON schema keyword(s) {names} not supported"
    if "oneOf constraints are not supported" in message:
        return ("JSON schema keyword 'oneOf' is only supported when its alternatives provably "
                "exclude each other; use 'anyOf'")
    if "Unknown format:" in message:
        fmt = _rest_of_line(message.split("Unknown format:", 1)[1])
        return f"JSON schema keyword 'format' with value '{fmt}' is not supported"
    return f"unsupported JSON schema: {_rest_of_line(message)[:500]}"


def _rest_of_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


# ---- regex and choice ---------------------------------------------------------------------------

def check_regex(pattern: str, param: str = "regex") -> str:
    """Refuse what the regex backends cannot do: look-around, back-references, a leading `^` or `\\A`
    (the whole output is matched anyway), and syntax errors (Rust `regex` syntax). Returns the
    pattern without a trailing `$` or `\\z`, which say nothing when the whole output must match."""
    problem = _regex_problem(pattern)
    if problem:
        raise ConstraintError(f"regex {pattern!r}: {problem}", param)
    _validate(LLMatcher.grammar_from_regex(pattern), param,
              lambda m: f"invalid regex {pattern!r}: {m}")
    return _strip_end_anchor(pattern)


def _strip_end_anchor(rx: str) -> str:
    for anchor in ("$", "\\z"):
        if rx.endswith(anchor):
            body = rx[:-len(anchor)]
            escapes = len(body) - len(body.rstrip("\\"))
            if escapes % 2 == 0:  # the anchor itself is not escaped
                return body
    return rx


def _regex_problem(rx: str) -> str | None:
    i = 0
    while True:  # skip the group openers in front of a leading anchor: "(^a)", "(?:^a)"
        if rx.startswith("(?:", i):
            i += 3
        elif rx.startswith("(", i) and not rx.startswith("(?", i):
            i += 1
        else:
            break
    if rx.startswith("^", i) or rx.startswith("\\A", i):
        return "a leading '^' anchor is not supported (the whole output must match anyway)"
    depth = 0  # character-class nesting
    i = 0
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            nxt = rx[i + 1:i + 2]
            if nxt.isdigit() and nxt != "0" or (nxt == "k" and rx[i + 2:i + 3] in ("<", "{", "'")):
                return "back-references are not supported"
            i += 2
            continue
        if depth:
            if c == "[":
                depth += 1
            elif c == "]":
                depth -= 1
        elif c == "[":
            depth = 1
            i += 1
            if rx.startswith("^", i):
                i += 1
            if rx.startswith("]", i):  # a leading ']' is literal
                i += 1
            continue
        elif rx.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return "look-around assertions are not supported"
        i += 1
    return None


def _escape(literal: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in literal)


def choice_regex(value: str) -> str:
    """The regex matching exactly one of the choices (a JSON list of strings)."""
    try:
        choices = json.loads(value)
    except (TypeError, ValueError):
        raise ConstraintError("choice must be a JSON list of strings", "choice") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ConstraintError("choice must be a non-empty list of strings", "choice")
    if "" in choices:
        raise ConstraintError("choice must not contain an empty string", "choice")
    return "(" + "|".join(_escape(c) for c in choices) + ")"


# ---- grammars and structural tags ---------------------------------------------------------------

def _grammar(text: str) -> str:
    try:
        lark = any_to_lark(text)  # Lark as is; GBNF converted to Lark
    except Exception as e:  # noqa: BLE001 (the GBNF converter raises plain Exceptions)
        raise ConstraintError(f"invalid grammar: {e}", "grammar") from None
    grammar = _lark(lark)
    _validate(grammar, "grammar", lambda m: f"invalid grammar: {m}")
    return grammar


def _structural_tag(spec: Constraint) -> str:
    try:
        tag = json.loads(spec.value)
    except (TypeError, ValueError):
        raise ConstraintError("structural_tag must be JSON", "structural_tag") from None
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if (not isinstance(structures, list) or not structures or not isinstance(triggers, list)
            or not triggers or not all(isinstance(t, str) and t for t in triggers)):
        raise ConstraintError("structural_tag needs non-empty 'structures' and 'triggers' lists",
                              "structural_tag")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(
                s.get("end", ""), str):
            raise ConstraintError(f"structures[{i}] needs a 'begin' and an 'end' string",
                                  "structural_tag")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ConstraintError(f"structures[{i}].begin starts with none of the triggers",
                                  "structural_tag")
        schema = _load_schema(json.dumps(s.get("schema", {})), "structural_tag")
        if spec.disable_additional_properties:
            schema = _close_objects(schema)
        schema["x-guidance"] = json_options(spec)
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema,
                                         end=s.get("end", "")))
    # Triggers are text here: a tokenizer's special tokens are never part of constrained text.
    # (With JSON-schema bodies, to_grammar() gives one Lark grammar.)
    grammar = _lark(llguidance.StructTag.to_grammar(tags, assume_special=False))
    _validate(grammar, "structural_tag", _explain_json_error)
    return grammar


def _validate(grammar: str, param: str, explain) -> None:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(explain(messages[0] if messages else "invalid"), param)
