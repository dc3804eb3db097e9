"""`tool_choice: "required"` and named tool choice, enforced with a JSON-schema constraint.

As in vLLM, the constrained output is plain JSON rather than the model's own tool-call markup:
named -> the function's arguments object; required -> a non-empty array of
`{"name", "parameters"}` objects (one at most without parallel_tool_calls). `ToolJSONParser`
turns that JSON into tool calls once the output is complete."""

from __future__ import annotations

import json
import uuid
from typing import Any

from serve_app.errors import APIError
from serve_app.protocol import ChatCompletionRequest, NamedToolChoice
from serve_app.tool_parser import ParsedDelta, ParsedToolCall
from structured.spec import Constraint

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def tool_constraint(request: ChatCompletionRequest) -> tuple[Constraint, str | None] | None:
    """(constraint, the named function or None for required), or None when tools are free."""
    choice = request.tool_choice
    if not request.tools or choice in (None, "none", "auto"):
        return None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in request.tools if t.function.name == name), None)
        if tool is None:
            raise APIError(f"tool_choice names {name!r}, which is not in tools",
                           param="tool_choice")
        schema = _parameters(tool)
        return Constraint("json_schema", json.dumps(schema, sort_keys=True)), name
    items = [{"type": "object",
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return Constraint("json_schema", json.dumps(schema, sort_keys=True)), None


class ToolJSONParser:
    """The OutputParser interface for constrained tool output: nothing streams as content; the
    whole JSON becomes tool calls at the end."""

    def __init__(self, function: str | None) -> None:
        self.function = function
        self.text = ""
        self.tool_calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        return ParsedDelta()

    def flush(self) -> ParsedDelta:
        out = ParsedDelta()
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            out.content = self.text  # cut short (max_tokens): show what there is
            return out
        calls = ([{"name": self.function, "parameters": value}] if self.function is not None
                 else value)
        for call in calls:
            args = json.dumps(call["parameters"], ensure_ascii=False)
            parsed = ParsedToolCall(len(self.tool_calls),
                                    f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", call["name"], args)
            self.tool_calls.append(parsed)
            out.tool_calls.append(parsed)
        return out
