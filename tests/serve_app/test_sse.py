"""SSE events survive line readers that split on every Unicode line break."""

from __future__ import annotations

import json

from serve_app.stream import sse


def test_unicode_line_breaks_are_escaped_inside_events() -> None:
    text = "a\u2028b\u2029c\x85d\ne"
    event = sse({"choices": [{"delta": {"content": text}}]})
    assert event.endswith("\n\n") and event.startswith("data: ")
    assert len(event[:-2].splitlines()) == 1  # str.splitlines knows all of them
    assert json.loads(event[len("data: "):-2])["choices"][0]["delta"]["content"] == text
