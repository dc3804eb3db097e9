"""Incremental detokenization with stop strings.

UTF-8 safety comes from `tokenizers`' DecodeStream (it holds a token back while it ends inside a
multi-byte character). Stop strings can span token boundaries, so text that could still be the
start of a stop string is held back until the next tokens decide it; once a stop string appears,
output is cut before it (or after it, with include_stop_str_in_output), and the output's tokens
end at the one that completed it, however many more the engine had sent with it (`used`).
Tokens are checked one by one for that. As vLLM, stop strings count only from the `min_tokens`-th
output token on.

When generation ends inside a multi-byte character, `flush` releases those bytes as U+FFFD, as a
whole-sequence decode would. With `skip_special_tokens` off, `spaces_between_special_tokens`
(vLLM's switch) joins every added/special token to its neighbouring text with one space; off, they
are concatenated as they are."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@functools.lru_cache(maxsize=16)
def _proper_prefixes(stop: tuple[str, ...]) -> tuple[frozenset[str], int]:
    """Every proper prefix of the stop strings, and the longest one's length (shared by the
    choices of a request and by requests that send the same stop strings; at the caps a set
    is ~0.5 MB, so few are kept)."""
    prefixes = frozenset(s[:k] for s in stop for k in range(1, len(s)))
    return prefixes, max((len(s) - 1 for s in stop), default=0)


@dataclass(frozen=True)
class DetokenizedDelta:
    text: str
    stop: str | None = None  # the stop string that ended the output, if any
    # how many of the tokens given belong to the output: with a stop string, those up to the
    # one that completed it (vLLM's rule: include_stop_str_in_output decides only the text)
    used: int = 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 prompt_tail: list[int] | None = None,
                 spaces_between_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # added tokens (special or not) by id: only needed to space them out
        self.added: dict[int, str] = {}
        if not skip_special_tokens and spaces_between_special_tokens:
            self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._last_kind: str | None = None  # "text" | "added": what the last emitted piece was
        self._ids: list[int] = []
        self._emitted = 0  # self._ids[:_emitted] are reflected in emitted text
        if prompt_tail:
            # sentencepiece-style decoders need the previous token to place a leading space
            for t in prompt_tail:
                self.stream.step(tokenizer, t)
            self._ids = list(prompt_tail)
            self._emitted = len(self._ids)
        self.stop = [s for s in (stop or []) if s]
        self._prefixes = _proper_prefixes(tuple(self.stop))
        self.include_stop = include_stop_str_in_output
        # as vLLM, stop strings are looked for only from the min_tokens-th output token on
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.held = ""
        self.stopped: str | None = None
        self._texts: list[str] = []  # everything emitted so far (`text`), piece by piece

    @property
    def text(self) -> str:
        """Everything emitted so far (joined when asked: a string grown a token at a time is
        copied whole on every token)."""
        return "".join(self._texts)

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string: one
        set lookup per suffix length, whatever the number of stop strings (the text is what
        was held back plus the new piece, a few characters unless a stop string is under way)."""
        prefixes, longest = self._prefixes
        for k in range(min(longest, len(text)), 0, -1):
            if text[-k:] in prefixes:
                return k
        return 0

    def _spaced(self, text: str, kind: str) -> str:
        """vLLM's `" ".join(sub_texts)`: a space wherever an added token meets other output."""
        if not text:
            return ""
        if self._last_kind is not None and "added" in (kind, self._last_kind):
            text = " " + text
        self._last_kind = kind
        return text

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self.stream.step(self.tokenizer, token_id)
        if piece is None:  # inside a multi-byte character (or a skipped special token)
            return ""
        self._emitted = len(self._ids)
        if not self.added:
            return piece
        content = self.added.get(token_id)
        if content is not None and piece.endswith(content):
            # the piece may start with bytes held back before the added token
            return (self._spaced(piece[: len(piece) - len(content)], "text")
                    + self._spaced(content, "added"))
        return self._spaced(piece, "text")

    def _pending(self) -> str:
        """The text of tokens DecodeStream still holds (an incomplete character) as U+FFFD."""
        if self._emitted >= len(self._ids):
            return ""
        pending = self._ids[self._emitted:]
        ctx = self._ids[self._emitted - 1: self._emitted] if self._emitted else []
        skip = self.skip_special_tokens
        full = self.tokenizer.decode(ctx + pending, skip_special_tokens=skip)
        head = self.tokenizer.decode(ctx, skip_special_tokens=skip) if ctx else ""
        text = (full[len(head):] if full.startswith(head)
                else self.tokenizer.decode(pending, skip_special_tokens=skip))
        self._emitted = len(self._ids)
        return self._spaced(text, "text") if self.added else text

    def add(self, token_ids: list[int] | tuple[int, ...]) -> DetokenizedDelta:
        if self.stopped is not None:
            return DetokenizedDelta("", self.stopped, 0)
        if not self.stop:
            self.num_tokens += len(token_ids)
            buf = self.held + "".join(self._step(t) for t in token_ids)
            self.held = ""
            self._texts.append(buf)
            return DetokenizedDelta(buf, used=len(token_ids))
        # token by token: the tokens after the one that completes a stop string are not output
        out = []
        for used, token in enumerate(token_ids, start=1):
            self.num_tokens += 1
            piece, stop = self._add_checked(self._step(token))
            out.append(piece)
            if stop is not None:
                return DetokenizedDelta("".join(out), stop, used)
        return DetokenizedDelta("".join(out), used=len(token_ids))

    def _add_checked(self, piece: str) -> tuple[str, str | None]:
        """One token's text against the stop strings: what may be emitted now, and the stop
        string it completed, if any."""
        buf = self.held + piece
        if self.num_tokens < self.min_tokens:
            self.held = ""
            self._texts.append(buf)
            return buf, None
        # a stop string may start in text already held back, so search the whole buffer
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            out = buf[: i + len(s)] if self.include_stop else buf[:i]
            self.held, self.stopped = "", s
            self._texts.append(out)
            return out, s
        keep = self._partial_stop_len(buf)
        out = buf[: len(buf) - keep]
        self.held = buf[len(buf) - keep:]
        self._texts.append(out)
        return out, None

    def flush(self) -> str:
        """Once generation has ended: releases text held back for a possible stop string and
        the bytes of an unfinished character."""
        if self.stopped is not None:
            return ""
        out, self.held = self.held + self._pending(), ""
        self._texts.append(out)
        return out
