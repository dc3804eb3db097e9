"""Per-request constraint state: which tokens may come next, and the state after each token.

The engine owns one Guide per constrained sequence (never keyed by batch row: rows change every
step). Per step it calls `fill_bitmask(bitmask, row)` for the row the sequence has this step, samples,
then `advance(token)`. A sampled EOS ends the sequence: the engine does not advance on it (a guide
given EOS while EOS is allowed just records the end).

Bitmask: packed int32 `[batch, ceil(vocab.size / 32)]`, CPU, contiguous; bit `t % 32` of word
`t // 32` set means token t is allowed. Masks are written straight into the row by the backend,
never built from token lists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from structured.errors import InvalidTokenError

if TYPE_CHECKING:
    import llguidance
    import outlines_core

    from structured.vocabulary import Vocabulary

DEFAULT_MAX_FORCED = 16


def _row_pointer(bitmask: torch.Tensor, row: int, words: int) -> int:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError("bitmask must be a 2-D int32 CPU tensor")
    if bitmask.shape[1] != words or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask rows must be {words} contiguous int32 words")
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"row {row} out of range for a bitmask of {bitmask.shape[0]} rows")
    return bitmask.data_ptr() + row * bitmask.stride(0) * 4


def _bit(token_id: int) -> int:
    """The int32 word value with token_id's bit set (bit 31 is the sign bit)."""
    value = 1 << (token_id & 31)
    return value - (1 << 32) if value >= 1 << 31 else value


def write_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Make `token_ids` the only allowed tokens of the row."""
    bitmask[row].zero_()
    for t in token_ids:
        bitmask[row, t >> 5] |= _bit(t)


class Guide(ABC):
    """The state of one constrained output. Not thread-safe; one per sequence."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.ended = False  # an EOS was accepted: the output is complete

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (every word of the row is written)."""

    def advance(self, token_id: int) -> None:
        """Consume one sampled token. Raises InvalidTokenError when the state does not allow it
        (the guide is then unusable). EOS, when allowed, ends the output and changes nothing."""
        if token_id in self.vocab.eos_token_ids:
            if not self.is_finished():
                raise InvalidTokenError(f"EOS ({token_id}) before the output is complete")
            self.ended = True
            return
        if self.ended:
            raise InvalidTokenError(f"token {token_id} after EOS")
        self._advance(token_id)

    def advance_many(self, token_ids: Sequence[int]) -> None:
        """Consume several tokens in order (e.g. forced tokens); same rules as advance()."""
        for t in token_ids:
            self.advance(t)

    @abstractmethod
    def _advance(self, token_id: int) -> None: ...

    @abstractmethod
    def is_finished(self) -> bool:
        """The output so far is complete: EOS is allowed now (more tokens may be allowed too)."""

    @abstractmethod
    def can_only_finish(self) -> bool:
        """Nothing but EOS is allowed: the output must stop now."""

    @abstractmethod
    def forced_tokens(self, max_tokens: int = DEFAULT_MAX_FORCED) -> list[int]:
        """Tokens the constraint forces from here, in order (at most max_tokens), for jump-forward
        decoding. Does not advance: feed them back with advance_many()."""


# ---- outlines-core ------------------------------------------------------------------------------
#
# outlines-core 0.2.14 drops a token when the text before its last byte completes the regex and the
# whole token does not (regex-automata reports matches one byte late): after "12" under
# `[0-9]+(\.[0-9]+)?` the token "." is missing, so decimals can never be written; after a complete
# match a lone UTF-8 lead byte (byte-fallback `<0xE6>`) is missing, so characters without a merged
# token cannot be written either. So we compile R as `(?:R)` + U+10FFFF with a sentinel token
# spelling U+10FFFF, and no regular token holding its lead byte 0xF4 (see vocabulary.py): no text
# the model writes completes that regex, so no token is dropped, and the sentinel is unreachable
# without the sentinel token. The output so far matches R exactly when the sentinel token leads to a
# final state. The sentinel's id lies past every bitmask bit, so it never reaches a mask; EOS bits
# are set by the guide.

def outlines_regex(regex: str) -> str:
    """The regex outlines-core compiles for `regex` (whole-output match semantics)."""
    return f"(?:{regex})\\x{{10FFFF}}"


class OutlinesAutomaton:
    """A compiled outlines-core Index (of `outlines_regex(R)`) plus facts about its states, learned
    lazily and shared by every guide of one compiled constraint."""

    def __init__(self, index: outlines_core.Index, vocab: Vocabulary) -> None:
        self.index = index
        self.vocab = vocab
        self._sentinel = vocab.outlines_sentinel_id
        # state -> (forced token or None, R complete (EOS allowed), nothing but EOS allowed,
        #           nothing at all allowed: a dead end the vocabulary cannot write past)
        self._facts: dict[int, tuple[int | None, bool, bool, bool]] = {}

    def facts(self, state: int) -> tuple[int | None, bool, bool, bool]:
        known = self._facts.get(state)
        if known is not None:
            return known
        index = self.index
        allowed = index.get_allowed_tokens(state) or []
        after_sentinel = index.get_next_state(state, self._sentinel)
        final = after_sentinel is not None and index.is_final_state(after_sentinel)
        others = [t for t in allowed if t != self._sentinel] if len(allowed) <= 2 else allowed
        forced = others[0] if len(others) == 1 and not final else None
        known = self._facts[state] = (forced, final, final and not others, not final and not others)
        return known

    def has_final_state(self) -> bool:
        return bool(self.index.get_final_states())

    def new_guide(self) -> OutlinesGuide:
        import outlines_core

        return OutlinesGuide(self, outlines_core.Guide(self.index))


class OutlinesGuide(Guide):
    def __init__(self, automaton: OutlinesAutomaton, guide: outlines_core.Guide) -> None:
        super().__init__(automaton.vocab)
        self._automaton = automaton
        self._guide = guide

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = self.vocab.bitmask_words
        ptr = _row_pointer(bitmask, row, words)
        if self.ended:
            write_only(bitmask, row, self.vocab.eos_token_ids)
            return
        _, final, _, dead = self._automaton.facts(self._guide.get_state())
        if dead:  # never an all-zero row: end the sequence instead (like llguidance's error state)
            write_only(bitmask, row, self.vocab.eos_token_ids)
            return
        self._guide.write_mask_into(ptr, words, 4)
        if final:
            for t in self.vocab.eos_token_ids:
                bitmask[row, t >> 5] |= _bit(t)

    def _advance(self, token_id: int) -> None:
        if token_id >= self.vocab.size:
            raise InvalidTokenError(f"token {token_id} is outside the vocabulary")
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError as e:
            raise InvalidTokenError(str(e)) from None

    def is_finished(self) -> bool:
        return self.ended or self._automaton.facts(self._guide.get_state())[1]

    def can_only_finish(self) -> bool:
        return self.ended or self._automaton.facts(self._guide.get_state())[2]

    def forced_tokens(self, max_tokens: int = DEFAULT_MAX_FORCED) -> list[int]:
        if self.ended:
            return []
        tokens: list[int] = []
        state = self._guide.get_state()
        while len(tokens) < max_tokens:
            forced = self._automaton.facts(state)[0]
            if forced is None:
                break
            tokens.append(forced)
            state = self._automaton.index.get_next_state(state, forced)
        return tokens


# ---- llguidance ---------------------------------------------------------------------------------

class LLGuidanceGuide(Guide):
    def __init__(self, matcher: llguidance.LLMatcher, vocab: Vocabulary) -> None:
        super().__init__(vocab)
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = self.vocab.bitmask_words
        ptr = _row_pointer(bitmask, row, words)
        if self.ended:
            write_only(bitmask, row, self.vocab.eos_token_ids)
            return
        # In an error state llguidance allows only EOS, which ends the sequence.
        self._matcher.unsafe_compute_mask_ptr(ptr, words * 4)

    def _advance(self, token_id: int) -> None:
        if self._matcher.try_consume_tokens([token_id]) != 1:
            raise InvalidTokenError(f"token {token_id} is not allowed here")

    def advance_many(self, token_ids: Sequence[int]) -> None:
        token_ids = list(token_ids)
        if not token_ids or any(t in self.vocab.eos_token_ids for t in token_ids) or self.ended:
            super().advance_many(token_ids)
            return
        done = self._matcher.try_consume_tokens(token_ids)
        if done != len(token_ids):
            raise InvalidTokenError(f"token {token_ids[done]} is not allowed here")

    def is_finished(self) -> bool:
        return self.ended or self._matcher.is_accepting()

    def can_only_finish(self) -> bool:
        return self.ended or self._matcher.is_stopped()

    def forced_tokens(self, max_tokens: int = DEFAULT_MAX_FORCED) -> list[int]:
        if self.ended or self._matcher.is_stopped():
            return []
        # With no_forcing grammars (see schema_check.py) compute_ff_tokens() only answers once the
        # forced bytes have been computed.
        if not self._matcher.compute_ff_bytes():
            return []
        return self._matcher.compute_ff_tokens()[:max_tokens]
