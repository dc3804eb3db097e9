"""Tool-call and reasoning parsing of generated text, one parser for streaming and non-streaming.

Reasoning is `<think>...</think>` at the start of the answer (serve_app/reasoning_formats.py);
tool calls are sections whose markers and syntax depend on the model family
(serve_app/tool_formats.py). Text arrives in arbitrary pieces, so any suffix that could be the
start of a marker is held back until the next piece decides it, and a section is parsed once it
is closed (or the output ends): streamed and whole output parse the same way. A section that
does not parse is passed through as content, as vLLM does."""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.reasoning_formats import THINK_CLOSE, THINK_OPEN, ReasoningFormat
from serve_app.tool_formats import Schemas, ToolFormat, parse_section

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
    """`reasoning`: the model's reasoning format, None to take none out; `tools`: its tool-call
    format, None when the request's output is not parsed for calls; `schemas`: the request's
    tools' parameter schemas (formats that write values as text use them for types)."""

    def __init__(self, reasoning: ReasoningFormat | None, include_reasoning: bool,
                 tools: ToolFormat | None, start_in_reasoning: bool = False,
                 parallel_tool_calls: bool = True, schemas: Schemas | None = None) -> None:
        self.reasoning = reasoning
        # without parallel_tool_calls only the first call is returned (vLLM), under "auto" too
        self.max_tool_calls = None if parallel_tool_calls else 1
        self.include_reasoning = include_reasoning
        self.tools = tools
        self.schemas = schemas or {}
        # "start": reasoning may still open; "reasoning"; "content"; "tool": inside a section
        self.state = "reasoning" if start_in_reasoning else ("start" if reasoning is not None
                                                             else "content")
        self.buf = ""
        self.tool_calls: list[ParsedToolCall] = []
        self._after_think = False  # newlines right after </think> are dropped, however split
        self._answer_started = False  # (for formats whose section opens only the answer)
        self._marker = ""  # the marker that opened the current section
        self._may_reopen = start_in_reasoning
        self._pending_space = ""

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

    def _emit_content(self, out: ParsedDelta, text: str) -> None:
        if self.tool_calls and not text.strip():
            # whitespace between or after calls is content only if more text follows it
            self._pending_space += text
            return
        out.content += self._pending_space + text
        self._pending_space = ""
        if text.strip():
            self._answer_started = True

    def _open_markers(self) -> tuple[str, ...]:
        assert self.tools is not None
        if self.tools.at_start_only and self._answer_started:
            return ()
        return self.tools.opens

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
                if self._may_reopen:
                    # started inside reasoning, the answer may still write its own <think>
                    stripped = self.buf.lstrip()
                    if not final and THINK_OPEN.startswith(stripped):
                        return
                    self._may_reopen = False
                    if stripped.startswith(THINK_OPEN):
                        self.buf = stripped[len(THINK_OPEN):]
                        continue
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
                if self.tools is None:
                    self._emit_content(out, self.buf)
                    self.buf = ""
                    return
                markers = self._open_markers()
                if self.tools.at_start_only and markers:
                    # such a section opens only where the answer begins, past its whitespace
                    stripped = self.buf.lstrip()
                    marker = next((m for m in markers if stripped.startswith(m)), None)
                    if marker is not None:
                        self._open_section(marker, stripped)  # (the whitespace goes)
                        continue
                    leading = len(self.buf) - len(stripped)
                    if not final and leading <= MAX_LEADING_WHITESPACE and (
                            not stripped or any(m.startswith(stripped) for m in markers)):
                        return  # could still become a marker
                    self._emit_content(out, self.buf)
                    self.buf = ""
                    return
                found = [(self.buf.find(m), m) for m in markers if m in self.buf]
                if found:
                    i, marker = min(found)
                    self._emit_content(out, self.buf[:i])
                    self._open_section(marker, self.buf[i:])
                    continue
                keep = 0 if final else max((_partial_tag(self.buf, m) for m in markers),
                                           default=0)
                self._emit_content(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            else:  # tool
                close = self.tools.close if self.tools is not None else None
                i = self.buf.find(close) if close else -1
                if i < 0:
                    if final:  # unterminated (or running to the end): try it as calls
                        self._section(out, self.buf, closed=False)
                        self.buf = ""
                    return
                self._section(out, self.buf[:i], closed=True)
                self.buf = self.buf[i + len(close):]  # type: ignore[arg-type]
                self.state = "content"

    def _open_section(self, marker: str, text: str) -> None:
        self._marker = marker
        self.buf = text[len(marker):]
        self.state = "tool"
        self._answer_started = True

    def _section(self, out: ParsedDelta, body: str, closed: bool) -> None:
        assert self.tools is not None
        calls, shown = parse_section(self.tools, self._marker, body, closed, self.schemas)
        if calls is None:
            out.content += shown
            return
        for name, arguments in calls:
            if self.max_tool_calls is not None and len(self.tool_calls) >= self.max_tool_calls:
                return
            call = ParsedToolCall(len(self.tool_calls), self.tools.new_id(), name, arguments)
            self.tool_calls.append(call)
            out.tool_calls.append(call)
