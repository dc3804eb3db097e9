"""Tool-call and reasoning parsing of generated text, one parser for streaming and non-streaming.

The embedded model (and Qwen2.5/Qwen3/Hermes-style models) write reasoning as
`<think>...</think>` at the start of the answer and tool calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. Text arrives in arbitrary
pieces, so any suffix that could be the start of a tag is held back until the next piece decides
it. A tool-call block whose JSON does not parse is passed through as content, as vLLM does."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# whitespace the answer may start with before its <think>: while the text so far is no more than
# this much whitespace it is held (it may still turn into reasoning); beyond it, the answer is
# content. Unbounded, an answer of newlines streamed nothing until it ended.
MAX_LEADING_WHITESPACE = 8


@dataclass(frozen=True)
class ParsedToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class OutputParser:
    def __init__(self, parse_reasoning: bool, include_reasoning: bool, parse_tools: bool,
                 start_in_reasoning: bool = False, parallel_tool_calls: bool = True) -> None:
        self.parse_reasoning = parse_reasoning
        # without parallel_tool_calls only the first call is returned (vLLM), under "auto" too
        self.max_tool_calls = None if parallel_tool_calls else 1
        self.include_reasoning = include_reasoning
        self.parse_tools = parse_tools
        # "start": reasoning may still open; "reasoning"; "content"; "tool": inside a tool block
        self.state = "reasoning" if start_in_reasoning else ("start" if parse_reasoning
                                                             else "content")
        self.buf = ""
        self.tool_calls: list[ParsedToolCall] = []
        self._after_think = False  # newlines right after </think> are dropped, however split

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        self._run(out, final=False)
        return out

    def flush(self) -> ParsedDelta:
        out = ParsedDelta()
        self._run(out, final=True)
        return out

    def _emit_reasoning(self, out: ParsedDelta, text: str) -> None:
        if self.include_reasoning:
            out.reasoning += text

    def _run(self, out: ParsedDelta, final: bool) -> None:
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                may_open = len(self.buf) - len(stripped) <= MAX_LEADING_WHITESPACE
                if may_open and stripped.startswith(THINK_OPEN):
                    self.buf = stripped[len(THINK_OPEN):]
                    self.state = "reasoning"
                elif may_open and not final and THINK_OPEN.startswith(stripped):
                    return  # could still become <think>
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit_reasoning(out, self.buf[:i])
                    self.buf = self.buf[i + len(THINK_CLOSE):]
                    self.state = "content"
                    self._after_think = True
                    continue
                keep = 0 if final else _partial_tag(self.buf, THINK_CLOSE)
                self._emit_reasoning(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            elif self.state == "content":
                if self._after_think:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return  # only newlines so far: the next piece may bring more
                    self._after_think = False
                if not self.parse_tools:
                    out.content += self.buf
                    self.buf = ""
                    return
                i = self.buf.find(TOOL_OPEN)
                if i >= 0:
                    out.content += self.buf[:i]
                    self.buf = self.buf[i + len(TOOL_OPEN):]
                    self.state = "tool"
                    continue
                keep = 0 if final else _partial_tag(self.buf, TOOL_OPEN)
                out.content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return
            else:  # tool
                i = self.buf.find(TOOL_CLOSE)
                if i < 0:
                    if final:  # an unterminated block: try it as a call, else show it
                        self._tool_block(out, self.buf)
                        self.buf = ""
                    return
                self._tool_block(out, self.buf[:i])
                self.buf = self.buf[i + len(TOOL_CLOSE):]
                self.state = "content"

    def _tool_block(self, out: ParsedDelta, body: str) -> None:
        try:
            obj = json.loads(body)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError("name")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            out.content += TOOL_OPEN + body + TOOL_CLOSE
            return
        if self.max_tool_calls is not None and len(self.tool_calls) >= self.max_tool_calls:
            return
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call = ParsedToolCall(len(self.tool_calls), f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
                              name, arguments)
        self.tool_calls.append(call)
        out.tool_calls.append(call)
