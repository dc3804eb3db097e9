"""How each model family writes tool calls, and which family a chat template belongs to.

A `ToolFormat` names the markers that open (and close) a tool-call section of the output and
parses a finished section into calls; `serve_app/tool_parser.py` finds the sections in streamed
text, so every family parses streamed and whole output the same way. Names are vLLM's
`--tool-call-parser` names:

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...`
  `</function></tool_call>`, values as text, typed by the tool's JSON schema
- `llama3_json` (Llama 3.1-3.3): a JSON object `{"name": ..., "parameters": {...}}` as the whole
  answer, after an optional `<|python_tag|>`, several separated by `;`
- `mistral` (Mistral, Mixtral, Nemo): `[TOOL_CALLS]` then a JSON array of `{"name",
  "arguments"}`, or (tokenizer v11+) `[TOOL_CALLS]NAME[ARGS]{...}` per call; `[TOOL_CALLS]` is a
  special token, so this family's requests with tools keep special tokens in the text (as vLLM)
- `deepseek_v3` (DeepSeek V3, R1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a fenced JSON block + `<｜tool▁call▁end｜>`
  (V3.1's `NAME<｜tool▁sep｜>{...}` too), then `<｜tool▁calls▁end｜>`

A section that does not parse is shown as content, markers included, as vLLM does."""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from structured.schema_check import json_options
from structured.spec import Constraint

# (name, arguments as JSON text) of each call in a section
Calls = list[tuple[str, str]]
# a tool's name -> its parameters' JSON schema (for formats that write values as text)
Schemas = dict[str, dict[str, Any]]


def _openai_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:
    # Mistral's templates refuse tool_call ids that are not 9 letters or digits when the
    # conversation comes back with the tool's result
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


# the tools a forced choice may call, (name, parameters schema) each, and whether several calls
# are allowed -> a Lark grammar (llguidance) of output in the family's own syntax
Grammar = Callable[[list[tuple[str, dict[str, Any]]], bool], str]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opens: tuple[str, ...]  # any of these starts a section
    close: str | None  # ends it; None: the section runs to the end of the output
    parse: Callable[[str, Schemas], Calls | None]  # a section's text (markers off) -> calls
    grammar: Grammar  # `tool_choice` required or named: the calls the family writes, only
    # a section opens only where the answer (past leading whitespace) begins
    at_start_only: bool = False
    # open markers that are part of the section's text (llama3_json's `{`)
    kept_markers: tuple[str, ...] = ()
    # a marker is a special token, which the text must keep
    needs_special_tokens: bool = False
    new_id: Callable[[], str] = _openai_id


def _dump(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _named_call(obj: Any, *arg_keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a `{"name": ..., <arg key>: {...}}` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return obj["name"], _dump(args)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values `text` holds one after another (separated by whitespace, `;` or `,`)."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _parse_hermes(section: str, schemas: Schemas) -> Calls | None:
    try:
        call = _named_call(json.loads(section), "arguments", "parameters")
    except json.JSONDecodeError:
        return None
    return None if call is None else [call]


def _parse_llama3_json(section: str, schemas: Schemas) -> Calls | None:
    values = _json_values(section)
    if not values:
        return None
    calls = [_named_call(v, "parameters", "arguments") for v in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


_MISTRAL_V11 = re.compile(r"\s*([^\s\[\]{}]+?)\s*\[ARGS\]", re.S)


def _parse_mistral(section: str, schemas: Schemas) -> Calls | None:
    text = section.strip()
    if text.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
        values = _json_values(text)
        if not values or not all(isinstance(v, list) for v in values):
            return None
        calls = [_named_call(o, "arguments", "parameters") for v in values for o in v]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore
    calls = []  # NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}
    for part in text.split("[TOOL_CALLS]"):
        decoder, i = json.JSONDecoder(), 0
        while i < len(part.rstrip()):
            m = _MISTRAL_V11.match(part, i)
            if m is None:
                return None
            try:
                args, i = decoder.raw_decode(part, m.end())
            except json.JSONDecodeError:
                return None
            calls.append((m.group(1), _dump(args)))
    return calls or None


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_CALL = re.compile(f"{DS_CALL_BEGIN}(.*?){DS_SEP}(.*?){DS_CALL_END}", re.S)
_DS_FENCED = re.compile(r"\s*(\S+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*$", re.S)


def _parse_deepseek_v3(section: str, schemas: Schemas) -> Calls | None:
    calls = []
    for head, body in _DS_CALL.findall(section):
        fenced = _DS_FENCED.match(body)
        if head.strip() == "function" and fenced is not None:  # V3 / R1
            name, args = fenced.group(1), fenced.group(2)
        else:  # V3.1: NAME<｜tool▁sep｜>{...}
            name, args = head.strip(), body
        try:
            calls.append((name, _dump(json.loads(args))))
        except json.JSONDecodeError:
            return None
    rest = _DS_CALL.sub("", section).strip()
    return calls if calls and not rest else None


_QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                             re.S)


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    """A qwen3_coder parameter's text as the type its schema gives (text when none fits)."""
    kinds = (schema or {}).get("type", "string")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if value.strip().lower() == "null" and "string" not in kinds:
        return None
    for kind in kinds:
        try:
            if kind == "string":
                return value
            if kind == "integer":
                return int(value.strip())
            if kind == "number":
                number = float(value.strip())
                return int(number) if number.is_integer() and "." not in value else number
            if kind == "boolean":
                if value.strip().lower() in ("true", "false"):
                    return value.strip().lower() == "true"
            if kind in ("object", "array"):
                try:
                    return json.loads(value)
                except json.JSONDecodeError:
                    return ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            continue
    return value


def _parse_qwen3_coder(section: str, schemas: Schemas) -> Calls | None:
    calls = []
    for name, body in _QWEN_FUNCTION.findall(section):
        name = name.strip()
        properties = (schemas.get(name) or {}).get("properties") or {}
        args = {}
        for key, raw in _QWEN_PARAMETER.findall(body):
            key = key.strip()
            # the value sits between a newline after the tag and one before the closing tag
            value = raw[1:] if raw.startswith("\n") else raw
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, properties.get(key))
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    rest = _QWEN_FUNCTION.sub("", section).strip()
    return calls if calls and not rest else None



# ---- grammars for tool_choice "required" and named: the family's own syntax ---------------------
_JSON_OPTIONS = json_options(Constraint("json_schema", ""))  # bounded whitespace, never lenient


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def _call_object(tools: list[tuple[str, dict[str, Any]]], key: str) -> dict[str, Any]:
    """The JSON object of one call of any of the tools: {"name": <const>, key: <parameters>}."""
    objects = [{"type": "object", "properties": {"name": {"const": name}, key: schema},
                "required": ["name", key], "additionalProperties": False}
               for name, schema in tools]
    return objects[0] if len(objects) == 1 else {"anyOf": objects}


def _repeat(call: str, sep: str, many: bool) -> str:
    return f"start: {call}" + (f" ({_lit(sep)} {call})*" if many else "") + "\n"


def _grammar_hermes(tools: list[tuple[str, dict[str, Any]]], many: bool) -> str:
    return (_repeat("call", "\n", many)
            + f"call: {_lit('<tool_call>' + chr(10))} {_json(_call_object(tools, 'arguments'))}"
            f" {_lit(chr(10) + '</tool_call>')}\n")


def _grammar_llama3_json(tools: list[tuple[str, dict[str, Any]]], many: bool) -> str:
    return _repeat("call", "; ", many) + f"call: {_json(_call_object(tools, 'parameters'))}\n"


def _grammar_mistral(tools: list[tuple[str, dict[str, Any]]], many: bool) -> str:
    array = {"type": "array", "items": _call_object(tools, "arguments"), "minItems": 1}
    if not many:
        array["maxItems"] = 1
    return f"start: {_lit('[TOOL_CALLS]')} {_json(array)}\n"


def _grammar_deepseek_v3(tools: list[tuple[str, dict[str, Any]]], many: bool) -> str:
    calls = " | ".join(
        f"{_lit(DS_CALL_BEGIN + 'function' + DS_SEP + name + chr(10) + '```json' + chr(10))} "
        f"{_json(schema)} {_lit(chr(10) + '```' + DS_CALL_END)}" for name, schema in tools)
    return (f"start: {_lit(DS_CALLS_BEGIN)} call{'+' if many else ''} {_lit(DS_CALLS_END)}\n"
            f"call: {calls}\n")


# a qwen3_coder value as text: everything up to the newline before </parameter>
_QWEN_VALUE = {"integer": r"/-?[0-9]+\n/", "number": r"/-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?\n/",
               "boolean": r"/(true|false)\n/"}
_QWEN_TEXT = r"/[^<]*\n/"


def _qwen_value(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if kind in _QWEN_VALUE:
        return _QWEN_VALUE[kind]
    if kind in ("object", "array") or "type" not in schema and schema:
        return f"{_json(schema)} {_lit(chr(10))}"
    return _QWEN_TEXT  # strings (and values of no schema), without "<"


def _grammar_qwen3_coder(tools: list[tuple[str, dict[str, Any]]], many: bool) -> str:
    rules, calls = [], []
    for i, (name, schema) in enumerate(tools):
        required = set(schema.get("required") or ())
        params = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rules.append(f"p{i}_{j}: {_lit('<parameter=' + key + '>' + chr(10))} "
                         f"{_qwen_value(sub if isinstance(sub, dict) else {})} "
                         f"{_lit('</parameter>' + chr(10))}")
            params.append(f"p{i}_{j}" + ("" if key in required else "?"))
        calls.append(f"{_lit('<tool_call>' + chr(10) + '<function=' + name + '>' + chr(10))} "
                     f"{' '.join(params)} {_lit('</function>' + chr(10) + '</tool_call>')}")
    return (_repeat("call", "\n", many) + f"call: {' | '.join(calls)}\n"
            + "".join(r + "\n" for r in rules))


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", ("<tool_call>",), "</tool_call>", _parse_hermes, _grammar_hermes),
    ToolFormat("qwen3_coder", ("<tool_call>",), "</tool_call>", _parse_qwen3_coder,
               _grammar_qwen3_coder),
    ToolFormat("llama3_json", ("<|python_tag|>", "{"), None, _parse_llama3_json,
               _grammar_llama3_json, at_start_only=True, kept_markers=("{",)),
    ToolFormat("mistral", ("[TOOL_CALLS]",), None, _parse_mistral, _grammar_mistral,
               needs_special_tokens=True, new_id=_mistral_id),
    ToolFormat("deepseek_v3", (DS_CALLS_BEGIN,), DS_CALLS_END, _parse_deepseek_v3,
               _grammar_deepseek_v3),
)}


def parse_section(fmt: ToolFormat, marker: str, body: str, closed: bool,
                  schemas: Schemas) -> tuple[Calls | None, str]:
    """A section's calls (None when it does not parse), and the text it shows as content
    then: all of it, markers included."""
    text = marker + body if marker in fmt.kept_markers else body
    shown = marker + body + (fmt.close if closed and fmt.close else "")
    return fmt.parse(text, schemas), shown


def detect(template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches its model (hermes when it names none)."""
    t = template or ""
    if "<tool_call>" in t and "<function=" in t:
        return FORMATS["qwen3_coder"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "tool▁calls▁begin" in t:
        return FORMATS["deepseek_v3"]
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
