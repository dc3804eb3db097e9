"""The messages that cross between the ingress and a replica, and the engine's per-sequence state.

Token ids cross the Ray hop (`GenerateRequest` in, `TokenBatch`es out), plus, for a multimodal
model, each media item's encoder inputs (`MultiModalItem`: pixel arrays, not images).
`Sequence` is the engine's mutable state for one choice of one request."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from structured.spec import Constraint


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None
    # (name on the server's allowlist, constructor kwargs as JSON)
    logits_processors: tuple[tuple[str, str], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids for the engine's per-token check (up to the cap's 1,024 ids)."""
        return frozenset(self.stop_token_ids)

    @property
    def masks_tokens(self) -> bool:
        """Whether the request's own lists may forbid tokens or end on them: such a row gets no
        jump-forward (the tokens a constraint forces are sampled one by one, through those
        lists and the stop checks, so a forbidden one ends the output instead of slipping
        through, and a stop token stops it)."""
        return bool(self.allowed_token_ids is not None or self.logit_bias
                    or self.bad_words_token_ids or self.stop_token_ids or self.min_tokens)

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image (or other media item) of a prompt, as the encoder reads it.

    The prompt holds `length` placeholder tokens for it from `offset` on; the encoder turns `data`
    into `length` embedding rows that replace those tokens' embeddings. `key` (32 bytes, BLAKE2b
    of the decoded item and the processor settings) is its identity for the encoder cache and
    for the prefix cache's block keys: the same image shares both, different ones never do."""

    modality: str  # "image"
    offset: int
    length: int
    key: bytes
    data: dict[str, Any]  # encoder inputs as numpy arrays, e.g. {"pixel_values": [3, H, W]}


@dataclass(frozen=True, eq=False)
class MRopePositions:
    """Multimodal rotary positions (Qwen2-VL's M-RoPE: temporal, height, width) of a prompt:
    text tokens advance all three axes together, an image's tokens take their grid coordinates."""

    prompt: Any  # int64 numpy array [3, prompt tokens]
    delta: int  # a token at index p past the prompt has position p + delta on every axis


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    constraint: Constraint | None = None
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None
    # the constraint starts after this token (a reasoning model's end-of-thinking token)
    constraint_after: int | None = None
    # time.time() by which the engine must have scheduled the request, or it fails with a 503
    # (the ingress sets it on arrival, so time queued in Serve's router counts too)
    deadline: float | None = None
    # who asked (an API key's digest or an address), for per-client limits such as compiles
    client: str | None = None
    # the client's predicted output (Predicted Outputs), a draft the engine verifies
    prediction: tuple[int, ...] = ()
    # media items whose placeholder tokens the prompt holds, in prompt order
    mm_items: tuple[MultiModalItem, ...] = ()
    # a model with M-RoPE (model.uses_mrope): the prompt's 3-D positions; None: text positions
    mrope: MRopePositions | None = None
    # the ingress whose direct channel takes this request's rows from the engine core (set by
    # the replica: replicas/channel.py); None: they go through the replica
    ingress: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class TokenBatch(NamedTuple):
    """Every token one choice produced since the previous batch of that choice. Immutable as a
    NamedTuple rather than a frozen dataclass: one is made per row per step in the engine core
    and again in the front, and a NamedTuple is built in 0.9 us against the dataclass's 2.7."""

    choice_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # the stop token id that ended it, or with finish_reason "abort" why the engine ended it
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    replica: str | None = None  # on a request's first batch: the replica running it
    # prediction tokens the engine checked since the previous batch: kept / thrown away
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


RETRY_AFTER_S = 1  # what a 503 for overload tells clients to wait


class EngineError(Exception):
    """An error the ingress renders as an OpenAI error envelope with this HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "BadRequestError", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_
        self.retry_after = retry_after  # seconds, for 429/503: the Retry-After header

    def __reduce__(self) -> tuple:  # keep every field across the Ray hop
        return (EngineError, (self.message, self.status, self.param, self.type,
                              self.retry_after))


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_FINISHED = SequenceStatus.FINISHED


# slots: the engine core reads and sets a dozen of these fields per row per step
@dataclass(eq=False, slots=True)
class Sequence:
    """One choice of one request as the engine tracks it (mutable; lives on the engine's loop)."""

    seq_id: int
    request_id: str
    choice_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival: float = 0.0
    cache_salt: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # counts the times the block table was emptied (preempted, finished): a copy of the table
    # made under an older count (the model runner's) is stale
    table_epoch: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: Any = None  # torch.Generator for seeded sampling
    guide: Any = None  # structured.guide.Guide when constrained
    guide_active: bool = True  # False while a reasoning block precedes the constraint
    constraint_after: int | None = None
    logits_processors: list[Any] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # replicas.sampler.RowTables: the request's lists as tensors, made on the first step
    sampling_tables: Any = None
    # Predicted Outputs (replicas/prediction.py): the prediction, where the output is expected
    # to resume it, and the draft tokens appended for the next step to verify
    prediction: tuple[int, ...] = ()
    prediction_pos: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted_prediction: int = 0  # since the last batch
    rejected_prediction: int = 0
    # the engine may schedule this sequence's next step before its last step's token is known
    # (async scheduling): nothing that step computes or samples for it reads that token
    # (no penalties, min_tokens, multi-token bad words, logits processors, constraint,
    # prediction or prompt logprobs)
    schedules_ahead: bool = False
    # media items of the prompt, and the prompt as block keys see it (block_hash.media_key_tokens)
    mm_items: tuple[MultiModalItem, ...] = ()
    key_prompt: list[int] | None = None
    mrope: MRopePositions | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        # a module constant: looking the member up on the enum class each time cost 75 of the
        # property's 186 ns, and the core asks ~6 times per row per step
        return self.status is _FINISHED

    def key_tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) as the prefix cache's block keys see them."""
        if self.key_prompt is None or start >= self.num_prompt_tokens:
            return tuple(self.token_ids[start:end])
        return (*self.key_prompt[start:end],
                *self.token_ids[max(start, self.num_prompt_tokens):end])


def coalesce(items: list[TokenBatch]) -> tuple[TokenBatch, ...]:
    """Batches in order -> one per choice (tokens, logprobs and counts joined)."""
    merged: dict[int, TokenBatch] = {}
    for b in items:
        prev = merged.get(b.choice_index)
        if prev is None:
            merged[b.choice_index] = b
            continue
        lps = None if prev.logprobs is None else prev.logprobs + (b.logprobs or ())
        merged[b.choice_index] = TokenBatch(
            b.choice_index, prev.token_ids + b.token_ids, lps, b.finish_reason, b.stop_reason,
            prev.num_prompt_tokens, prev.num_cached_tokens,
            prev.prompt_logprobs if prev.prompt_logprobs is not None else b.prompt_logprobs,
            prev.replica,
            accepted_prediction_tokens=(prev.accepted_prediction_tokens
                                        + b.accepted_prediction_tokens),
            rejected_prediction_tokens=(prev.rejected_prediction_tokens
                                        + b.rejected_prediction_tokens))
    return tuple(merged.values())
