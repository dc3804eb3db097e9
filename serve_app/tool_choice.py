"""`tool_choice: "required"` and named tool choice, enforced with a grammar constraint.

The constrained output is the served model's own tool-call syntax (serve_app/tool_formats.py:
`<tool_call>` blocks for hermes, `[TOOL_CALLS]` for mistral, ...), so the model writes what it
was trained to write and the same parser as under `auto` reads the calls: required -> one call
or more of any of the tools (one at most without parallel_tool_calls); named -> one call of that
function. Where vLLM constrains every family to one plain JSON shape, a model here never has to
write a format it has not seen."""

from __future__ import annotations

from serve_app.errors import APIError
from serve_app.protocol import ChatCompletionRequest, NamedToolChoice
from serve_app.tool_formats import ToolFormat
from structured.spec import Constraint

ANY_OBJECT = {"type": "object"}


def tool_constraint(request: ChatCompletionRequest, fmt: ToolFormat) -> Constraint | None:
    """The constraint of a forced tool choice, or None when the tools are free."""
    choice = request.tool_choice
    if not request.tools or choice in (None, "none", "auto"):
        return None
    tools = [(t.function.name, t.function.parameters or ANY_OBJECT) for t in request.tools]
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        named = [t for t in tools if t[0] == name]
        if not named:
            raise APIError(f"tool_choice names {name!r}, which is not in tools",
                           param="tool_choice")
        return Constraint("grammar", fmt.grammar(named[:1], False))
    return Constraint("grammar", fmt.grammar(tools, bool(request.parallel_tool_calls)))
