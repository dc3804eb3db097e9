"""Engine outputs -> OpenAI choices: detokenize, cut at stop strings, parse reasoning and tool
calls, collect logprobs and usage. `ChoiceState` turns each `TokenBatch` of one choice into a
`ChoiceDelta`; the ingress renders deltas as SSE chunks or folds them into one response."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from replicas.request import TokenBatch, TokenLogprob
from serve_app.detokenize import IncrementalDetokenizer
from serve_app.protocol import CompletionLogprobs, LogprobEntry, TopLogprob
from serve_app.sampling import OutputOptions
from serve_app.tool_parser import OutputParser, ParsedToolCall
from structured.vocabulary import token_to_bytes

NEG_INF_LOGPROB = -9999.0


@dataclass
class ChoiceDelta:
    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None




class TokenText:
    """Renders token ids as the strings logprobs report (cached per id), and their raw bytes: a
    token that ends inside a multi-byte character reads as U+FFFD, but its `bytes` are its own,
    so a client can join the bytes of consecutive tokens into the real text (as OpenAI's do)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_token_ids
        self.cache: dict[int, str] = {}
        self.bytes_cache: dict[int, list[int]] = {}
        self._added: dict[int, str] | None = None
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)

    def token_bytes(self, token_id: int) -> list[int]:
        if self.as_ids:
            return list(self(token_id).encode("utf-8"))
        out = self.bytes_cache.get(token_id)
        if out is None:
            raw = self._raw_bytes(token_id)
            out = list(raw if raw is not None else self(token_id).encode("utf-8", "replace"))
            self.bytes_cache[token_id] = out
        return out

    def _raw_bytes(self, token_id: int) -> bytes | None:
        if self._added is None:
            try:
                self._added = {i: str(getattr(t, "content", t)) for i, t in
                               self.tokenizer.added_tokens_decoder.items()}
            except AttributeError:
                self._added = {}
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:
            return None
        if not isinstance(piece, str):
            return None
        return token_to_bytes(piece, self._byte_level, byte_fallback=True,
                              spiece=not self._byte_level)

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.cache[token_id] = text
        return text

    def entry(self, lp: TokenLogprob, top_n: int) -> LogprobEntry:
        def top(tid: int, value: float) -> TopLogprob:
            return TopLogprob(token=self(tid), logprob=_finite(value),
                              bytes=self.token_bytes(tid))
        return LogprobEntry(token=self(lp.token_id), logprob=_finite(lp.logprob),
                            bytes=self.token_bytes(lp.token_id),
                            top_logprobs=[top(t, v) for t, v in lp.top[:top_n]])


def _finite(x: float) -> float:
    return NEG_INF_LOGPROB if x == float("-inf") or x != x else x


class ChoiceState:
    def __init__(self, index: int, tokenizer: Any, fast_tokenizer: Any, options: OutputOptions,
                 parser: OutputParser, token_text: TokenText, predicted: bool = False) -> None:
        self.index = index
        self.options = options
        self.detok = IncrementalDetokenizer(
            fast_tokenizer, options.skip_special_tokens, list(options.stop),
            options.include_stop_str_in_output,
            spaces_between_special_tokens=options.spaces_between_special_tokens,
            min_tokens=options.min_tokens)
        self.tokenizer = tokenizer
        self.parser = parser
        self.token_text = token_text
        self.token_ids: list[int] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # set when this side cut the output at a stop string: the engine's choice must end
        # there too (`stop_sent` once it has been told)
        self.stopped_at: int | None = None
        self.stop_sent = False
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs: tuple | None = None
        # the whole output so far, for non-streaming responses
        self.content = ""
        self.reasoning = ""
        self.logprobs: list[LogprobEntry] = []
        # Predicted Outputs: whether the request had a prediction, and the engine's counts of
        # its tokens kept and thrown away
        self.predicted = predicted
        self.accepted_prediction_tokens = 0
        self.rejected_prediction_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def on_batch(self, batch: TokenBatch) -> ChoiceDelta | None:
        if self.done:
            return None  # output was already cut at a stop string
        if batch.num_prompt_tokens:
            self.num_prompt_tokens = batch.num_prompt_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, batch.num_cached_tokens)
        if batch.prompt_logprobs is not None:
            self.prompt_logprobs = batch.prompt_logprobs
        delta = ChoiceDelta(self.index)
        ids = list(batch.token_ids)
        text = self.detok.add(ids[:-1] if self._ends_on_stop_token(batch) else ids)
        logprobs = batch.logprobs
        if text.stop is not None:
            self.finish_reason, self.stop_reason = "stop", text.stop
            # the tokens after the one that completed the stop string are not the client's:
            # not in token_ids, logprobs, usage or the best_of score
            ids = ids[:text.used]
            logprobs = None if logprobs is None else logprobs[:text.used]
            self.stopped_at = len(self.token_ids) + len(ids)
        elif batch.finish_reason is not None:
            self.finish_reason, self.stop_reason = batch.finish_reason, batch.stop_reason
        piece = text.text
        if self.done and text.stop is None:
            piece += self.detok.flush()
        self.token_ids.extend(ids)
        delta.token_ids = ids
        self.rejected_prediction_tokens += batch.rejected_prediction_tokens
        # kept prediction tokens past a stop string were never the client's
        self.accepted_prediction_tokens = min(
            self.accepted_prediction_tokens + batch.accepted_prediction_tokens,
            len(self.token_ids))
        if logprobs is not None:
            for lp in logprobs:
                self.cumulative_logprob += lp.logprob
                if self.options.logprobs:
                    delta.logprobs.append(self.token_text.entry(lp, self.options.top_logprobs))
        parsed = self.parser.feed(piece)
        if self.done:
            tail = self.parser.flush()
            parsed.content += tail.content
            parsed.reasoning += tail.reasoning
            parsed.tool_calls += tail.tool_calls
        delta.content, delta.reasoning, delta.tool_calls = (parsed.content, parsed.reasoning,
                                                            parsed.tool_calls)
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.logprobs += delta.logprobs
        if self.done:
            if self.parser.tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
            delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        return delta

    def _ends_on_stop_token(self, batch: TokenBatch) -> bool:
        """As vLLM: the text of the EOS or stop_token_ids token that ended the output is not part
        of it (its id and logprob are), unless include_stop_str_in_output."""
        if batch.finish_reason != "stop" or not batch.token_ids:
            return False
        if self.options.include_stop_str_in_output:
            return False
        last = batch.token_ids[-1]
        if batch.stop_reason is not None:
            return batch.stop_reason == last
        return last in set(getattr(self.tokenizer, "all_special_ids", ()) or ())

    def score(self, length_penalty: float) -> float:
        """best_of ranking: cumulative logprob over length ** length_penalty."""
        return self.cumulative_logprob / max(1, len(self.token_ids)) ** length_penalty


def completion_logprobs(entries: list[LogprobEntry], start: int,
                        echoed: tuple[list[int], tuple | None, TokenText, int] | None = None
                        ) -> CompletionLogprobs:
    """/v1/completions' logprobs shape for some tokens: `entries` of generated tokens, their
    text offsets counted from `start`; with `echoed` (prompt ids, their prompt logprobs, the
    token renderer, top n), the echoed prompt's tokens first, from offset 0 (as vLLM)."""
    lp = CompletionLogprobs()
    if echoed is not None:
        ids, prompt_entries, token_text, top_n = echoed
        offset = 0
        for tid, e in zip(ids, prompt_entries or (None,) * len(ids)):
            text = token_text(tid)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if e is None else _finite(e.logprob))
            lp.top_logprobs.append(None if e is None else
                                   {token_text(t): _finite(v) for t, v in e.top[:top_n]} or None)
            lp.text_offset.append(offset)
            offset += len(text)
    offset = start
    for e in entries:
        lp.tokens.append(e.token)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append({t.token: t.logprob for t in e.top_logprobs} or None)
        lp.text_offset.append(offset)
        offset += len(e.token)
    return lp


def prompt_logprobs_json(entries: tuple | None, prompt_ids: list[int],
                         token_text: TokenText) -> list[dict[str, Any] | None] | None:
    """vLLM's shape: one dict per prompt token, {token_id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in entries:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                "decoded_token": token_text(lp.token_id)}}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            d.setdefault(str(tid), {"logprob": _finite(value), "rank": rank,
                                    "decoded_token": token_text(tid)})
        out.append(d)
    return out[: len(prompt_ids)]


# Line breaks JSON leaves raw inside strings; line readers built on str.splitlines (httpx's
# aiter_lines among them) would cut an event there
_SSE_UNSAFE = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):
        text = obj.model_dump_json(exclude_unset=False, exclude_none=True)
    else:
        text = json.dumps(obj, ensure_ascii=False)
    return f"data: {text.translate(_SSE_UNSAFE)}\n\n"


def _json_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False).translate(_SSE_UNSAFE)


class ContentChunks:
    """A chat stream's content-only chunks as SSE events: the text `sse` makes of a
    `ChatCompletionChunk` whose one choice's delta carries only content (most of a stream's
    events), written from a prefix made once per request rather than through three pydantic
    models and a dump a token (2.5 against 12.3 us, warm; the ingress spends ~100-130 us a
    token in all)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self.prefix = (f'data: {{"id":{_json_str(request_id)},"object":"chat.completion.chunk",'
                       f'"created":{created},"model":{_json_str(model)},"choices":[{{"index":')

    def event(self, index: int, content: str) -> str:
        return f'{self.prefix}{index},"delta":{{"content":{_json_str(content)}}}}}]}}\n\n'


DONE = "data: [DONE]\n\n"
