"""The content-only chunks written without pydantic are the bytes `sse` makes of the models."""

from __future__ import annotations

import pytest

from serve_app.protocol import ChatCompletionChunk, ChunkChoice, Delta
from serve_app.stream import ContentChunks, sse

TEXTS = ["Hello", " world", "", 'quote " and back\\slash', "line\nbreak\ttab\r", "\x00\x1f\x7f",
         "é 漢字 🙂", "\u2028\u2029\x85", "</script>", "{\"json\": [1, 2]}", "\ufffd"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 3])
def test_content_chunks_match_the_models(text: str, index: int) -> None:
    rid, created, model = "chatcmpl-abc\u2028\"x", 1764300000, "shardserve/smollm2 \"q\" é"
    want = sse(ChatCompletionChunk(id=rid, created=created, model=model,
                                   choices=[ChunkChoice(index=index, delta=Delta(content=text))]))
    assert ContentChunks(rid, created, model).event(index, text) == want
