"""The constraint spec: what the ingress asks for, as plain data that crosses the Ray hop.

It is hashable so compiled indexes can be cached by (vocabulary, spec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class Constraint:
    """What the output must match.

    value by kind:
      json_schema     the schema as canonical JSON text
      json_object     "" (any JSON object)
      regex           the pattern (Rust syntax; the whole output must match)
      choice          a JSON list of the choices (strings)
      grammar         Lark or GBNF text
      structural_tag  JSON `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`
    whitespace_pattern: regex for the whitespace allowed between JSON tokens (json kinds); None means
      the bounded default `[ ]?`.
    disable_any_whitespace: compact JSON, no whitespace at all (wins over whitespace_pattern).
    disable_additional_properties: objects of the schema that do not say otherwise get
      `additionalProperties: false`.
    """

    kind: ConstraintKind
    value: str
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_any_whitespace: bool = False
