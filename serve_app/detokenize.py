"""Incremental detokenization with stop strings.

UTF-8 safety comes from `tokenizers`' DecodeStream (it holds a token back while it ends inside a
multi-byte character). Stop strings can span token boundaries, so text that could still be the
start of a stop string is held back until the next tokens decide it; once a stop string appears,
output is cut before it (or after it, with include_stop_str_in_output) and generation should end."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass(frozen=True)
class DetokenizedDelta:
    text: str
    stop: str | None = None  # the stop string that ended the output, if any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 prompt_tail: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        if prompt_tail:
            # sentencepiece-style decoders need the previous token to place a leading space
            for t in prompt_tail:
                self.stream.step(tokenizer, t)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.held = ""
        self.stopped: str | None = None
        self.text = ""  # everything emitted so far

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def add(self, token_ids: list[int] | tuple[int, ...]) -> DetokenizedDelta:
        if self.stopped is not None:
            return DetokenizedDelta("", self.stopped)
        new = []
        for t in token_ids:
            piece = self.stream.step(self.tokenizer, t)
            if piece:
                new.append(piece)
        buf = self.held + "".join(new)
        if not self.stop:
            self.held = ""
            self.text += buf
            return DetokenizedDelta(buf)
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
            self.text += out
            return DetokenizedDelta(out, s)
        keep = self._partial_stop_len(buf)
        out = buf[: len(buf) - keep]
        self.held = buf[len(buf) - keep:]
        self.text += out
        return DetokenizedDelta(out)

    def flush(self) -> str:
        """Releases text held back for a possible stop string once generation has ended."""
        out, self.held = self.held, ""
        self.text += out
        return out
