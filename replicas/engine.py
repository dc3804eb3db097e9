"""The engine: an async step loop over the scheduler, the executor and the sampler.

Requests join between steps and leave the moment they finish. Each step: schedule under the token
budget, run one batched forward (off the event loop, so new requests and outputs keep flowing), sample
the rows whose last token is new, apply stop rules, and hand every choice's new tokens, as
`TokenBatch`es, and every failed request's error to `on_outputs` in one call per step (the engine
core sends them to the replica as one message). A failure in one row's own work (its logits
processors, its constraint guide, its sampling tables) fails that row's request only. Knows
nothing of text: token ids in, token ids out.

With async scheduling (vLLM's) the next step is scheduled and queued while a step runs: its
sequences are advanced as if the step were done, each sampled token a placeholder that the
compute thread fills from the step before and the loop from the step's result; sequences whose
next step reads their last token (penalties, guides, processors...) keep the loop scheduling
after each result while they run."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replicas import kernels, prediction
from replicas.executor import Executor
from structured import bitmask as bitmask_lib
from replicas.kv_cache import BlockManager
from replicas.block_hash import media_key_tokens
from replicas.model_runner import (EncoderSlice, RowInput, StepInput, StepOutput,
                                   encoder_slices)
from replicas.request import (RETRY_AFTER_S, EngineError, GenerateRequest, Sequence,
                              SequenceStatus, TokenBatch, TokenLogprob)
from replicas.sampler import SamplerOutput, compute_logprobs, sample
from replicas.sampling_batch import SamplingBatch
from replicas.scheduler import ScheduledSeq, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

FINISHED_LENGTHS_KEPT = 4096  # choices whose output length a late stop_choice may need

# what a step hands on: each choice's new tokens, and each failed request's error
Outputs = list[tuple[str, TokenBatch]]
Errors = list[tuple[str, BaseException]]


# the token of a sequence's step in flight, in its token ids while the next step is scheduled
# ahead (no token id is negative)
PENDING = -1


def compute_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-compute")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024  # queued sequences before new requests get 429
    enable_prefix_caching: bool = True
    priority_scheduling: bool = False
    max_waiting_steps: int = 0  # scheduler.SchedulerConfig's
    # ids at and above this are padding rows of the embedding (no token): never sampled
    sampleable_vocab: int | None = None
    # a step running longer than this means the engine is wedged (health turns red)
    step_stall_s: float = 120.0
    # schedule each step while the one before it runs, where its sequences allow it
    # (Engine._launch_ahead)
    async_scheduling: bool = False


@dataclass(eq=False)
class _Step:
    """A step queued on the compute thread, until its result is taken in."""
    scheduled: list[ScheduledSeq]
    sampling: list[Sequence]  # the sequences of its rows that sample, in row order
    launched: float  # time.monotonic()
    work: asyncio.Future = field(init=False)
    # its sequences were advanced past it before its result (the next step was scheduled)
    advanced: bool = False
    # seq id -> the error its row's own work raised (its request fails)
    row_errors: dict[int, EngineError] = field(default_factory=dict)


@dataclass
class EngineStats:
    num_steps: int = 0
    prompt_tokens: int = 0  # computed (not cached) prompt tokens
    generation_tokens: int = 0
    # where the time goes: forward time of steps that only decode vs steps that also prefill
    decode_steps: int = 0
    decode_step_s: float = 0.0
    prefill_steps: int = 0
    prefill_step_s: float = 0.0
    forced_tokens: int = 0  # jump-forward: tokens appended without a decode step of their own
    steps_scheduled_ahead: int = 0  # async scheduling: steps queued before the last one's result
    # media items the encoder ran on, its seconds, and lookups the encoder cache answered
    encoder_items: int = 0
    encoder_s: float = 0.0
    encoder_cache_hits: int = 0
    # requests turned away: the waiting queue was full / not scheduled by their deadline
    rejected_queue_full: int = 0
    rejected_queue_wait: int = 0


def _encoder_slices(seq: Sequence, start: int, end: int) -> tuple[EncoderSlice, ...]:
    """The parts of the sequence's media items whose placeholders lie in tokens [start, end)."""
    if not seq.mm_items or start >= seq.num_prompt_tokens:
        return ()
    return encoder_slices(seq.mm_items, start, end)


def _mrope_positions(seq: Sequence, start: int, end: int) -> np.ndarray | None:
    """The 3-D positions of tokens [start, end) of a sequence with M-RoPE positions: the
    prompt's own, then p + delta on every axis."""
    if seq.mrope is None:
        return None
    n_prompt = seq.num_prompt_tokens
    parts = []
    if start < n_prompt:
        parts.append(seq.mrope.prompt[:, start:min(end, n_prompt)])
    if end > n_prompt:
        after = np.arange(max(start, n_prompt), end, dtype=np.int64) + seq.mrope.delta
        parts.append(np.broadcast_to(after, (3, len(after))))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def _apply_bitmask(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> None:
    """The guides' bitmask on the step's logits: in one native pass on CPUs (kernels:
    structured's tensor operations took 4 ms a step for 32 rows of 49,152 logits)."""
    if kernels.supports_draw(logits) and logits.is_contiguous():
        kernels.apply_bitmask(logits, words, rows)
    else:
        bitmask_lib.apply_bitmask(logits, words, rows)


def _internal_error(what: str, exc: Exception) -> EngineError:
    return EngineError(f"the request failed in its {what}: {type(exc).__name__}: {exc}",
                       status=500, type_="InternalServerError")


class Engine:
    def __init__(self, config: EngineConfig, executor: Executor, eos_ids: frozenset[int],
                 logits_processors: dict[str, Callable[..., Any]] | None = None,
                 compute: concurrent.futures.ThreadPoolExecutor | None = None) -> None:
        """`compute`: the one thread all torch work runs on (build the executor on it too)."""
        if config.num_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"KV cache of {config.num_blocks} blocks x {config.block_size} tokens cannot hold "
                f"one sequence of max_model_len {config.max_model_len}")
        self.config = config
        self.executor = executor
        self.compute = compute or compute_thread()
        self.eos_ids = eos_ids
        self.processor_factories = logits_processors or {}
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.priority_scheduling, config.max_waiting_steps), self.blocks)
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._requests: dict[str, list[Sequence]] = {}
        # gathered during a step, handed to on_outputs once at its end
        self.on_outputs: Callable[[Outputs, Errors], None] = lambda outputs, errors: None
        self._outputs: Outputs = []
        self._errors: Errors = []
        # the tokens the compute thread's last step sampled, by seq id (compute thread only):
        # a step scheduled ahead takes its rows' last tokens from them (`_resolve`)
        self._sampled: dict[int, int] = {}
        self._aborted: set[str] = set()
        # (request id, choice, output tokens kept): choices the ingress ended at a stop string
        self._stops: list[tuple[str, int, int]] = []
        # (request id, choice) -> output tokens, of choices finished lately: a stop string found
        # in a choice's last batch arrives after the engine is done with it
        self._finished_lengths: collections.OrderedDict[tuple[str, int], int] = (
            collections.OrderedDict())
        # request id -> time.monotonic() by which it must be scheduled (only until it is)
        self._deadlines: dict[str, float] = {}
        self._step_started: float | None = None  # time.monotonic() of the step in flight
        self.last_step_end = time.monotonic()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.failed: str | None = None  # set when a step fails: the shards may be gone
        # seq id -> (the sequence, its table_epoch, blocks of its table) as the model runners
        # hold it: each step sends them only the blocks tables gained (model_runner.StepInput)
        self._shipped: dict[int, tuple[Sequence, int, int]] = {}
        # the sampling rows' parameters as tensors, kept between steps (compute thread only)
        self.sampling_batch = SamplingBatch()

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, request: GenerateRequest, compiled: Any = None) -> None:
        """Queues a request; `compiled` (a structured.compiler.Compiled) when it is constrained.
        Raises EngineError when it cannot be queued (nothing of it is then kept)."""
        if self.failed is not None:
            raise EngineError(f"the model replica failed and is being replaced: {self.failed}",
                              status=503, type_="ServiceUnavailableError",
                              retry_after=RETRY_AFTER_S)
        if request.request_id in self._requests:
            raise EngineError(f"request id {request.request_id!r} is already running",
                              param="request_id")
        n_prompt = len(request.prompt_token_ids)
        if n_prompt == 0:
            raise EngineError("the prompt is empty", param="messages")
        for item in request.mm_items:
            if item.offset < 0 or item.length <= 0 or item.offset + item.length > n_prompt:
                raise EngineError(f"a {item.modality}'s placeholder tokens lie outside the "
                                  "prompt", param="messages")
        if request.mrope is not None and request.mrope.prompt.shape != (3, n_prompt):
            raise EngineError("the prompt's 3-D positions do not match its tokens",
                              param="messages")
        if n_prompt + request.params.max_tokens > self.config.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {n_prompt + request.params.max_tokens} tokens "
                f"({n_prompt} in the messages, {request.params.max_tokens} in the completion).",
                param="max_tokens")
        if len(self.scheduler.waiting) + request.n > self.config.max_waiting:
            self.stats.rejected_queue_full += 1
            raise EngineError("the server is overloaded: too many requests waiting; retry later",
                              status=503, type_="ServiceUnavailableError",
                              retry_after=RETRY_AFTER_S)
        self._ensure_loop()
        now = time.monotonic()
        seqs = []
        key_prompt = (media_key_tokens(request.prompt_token_ids, request.mm_items)
                      if request.mm_items else None)
        for i in range(request.n):
            seq = Sequence(next(self._seq_ids), request.request_id, i,
                           list(request.prompt_token_ids), n_prompt, request.params,
                           priority=request.priority, arrival=now, cache_salt=request.cache_salt)
            if request.params.seed is not None:
                seq.generator = torch.Generator().manual_seed(request.params.seed + i)
            if request.params.prompt_logprobs is not None and i == 0:
                # the choices share the prompt: its logprobs are computed once, on choice 0
                # (the others may then take its KV from the prefix cache)
                seq.prompt_logprobs = [None]
            seq.logits_processors = self._build_processors(request)
            seq.prediction = request.prediction
            seq.mm_items, seq.key_prompt, seq.mrope = request.mm_items, key_prompt, request.mrope
            if compiled is not None:
                seq.guide = compiled.new_guide()
                seq.guide_active = request.constraint_after is None
                seq.constraint_after = request.constraint_after
            p = request.params
            seq.schedules_ahead = not (
                p.needs_penalties or p.min_tokens or any(len(w) > 1 for w in p.bad_words_token_ids)
                or seq.logits_processors or seq.guide is not None or seq.prediction
                or seq.prompt_logprobs is not None)
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request.request_id] = seqs
        if request.deadline is not None:
            self._deadlines[request.request_id] = now + (request.deadline - time.time())
        self._wakeup.set()

    def _build_processors(self, request: GenerateRequest) -> list[Any]:
        out = []
        for name, kwargs in request.params.logits_processors:
            factory = self.processor_factories.get(name)
            if factory is None:
                raise EngineError(f"logits processor {name!r} is not on this server's allowlist",
                                  param="logits_processors")
            try:
                out.append(factory(**json.loads(kwargs)))
            except (TypeError, ValueError) as exc:
                raise EngineError(f"logits processor {name!r}: {exc}",
                                  param="logits_processors") from None
        return out

    def abort(self, request_id: str) -> None:
        """Marks a request aborted; the loop frees its blocks before the next step."""
        if request_id in self._requests:
            self._aborted.add(request_id)
            self._wakeup.set()

    def stop_choice(self, request_id: str, choice_index: int, num_output_tokens: int) -> None:
        """The ingress cut a choice's output at a stop string after `num_output_tokens`: the
        choice ends (its row and blocks are freed before the next step; its request's other
        choices go on), and the tokens it generated past that leave the counters, which so count
        only what clients got."""
        self._stops.append((request_id, choice_index, num_output_tokens))
        self._wakeup.set()

    def _apply_stops(self) -> None:
        for request_id, choice, kept in self._stops:
            seq = next((s for s in self._requests.get(request_id, ())
                        if s.choice_index == choice), None)
            if seq is None:
                generated = self._finished_lengths.pop((request_id, choice), kept)
            else:
                if seq.token_ids[-1] == PENDING:  # its step's token is dropped with it
                    seq.token_ids.pop()
                generated = seq.num_output_tokens
                if not seq.is_finished:
                    seq.finish_reason = "stop"
                    seq.status = SequenceStatus.FINISHED
                    self.scheduler.remove(seq)
                    self._emit(seq, (), None)  # ends the choice on the replica's stream
                self._finished_lengths.pop((request_id, choice), None)
            self.stats.generation_tokens -= max(0, generated - kept)
        self._stops.clear()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step loop -------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._loop_task
        if task is None or task.done() or task.get_loop() is not loop:
            self._wakeup = asyncio.Event()  # an Event binds to the loop that first waits on it
            self._loop_task = loop.create_task(self._run())
            self._loop_task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        """The loop only ends by an error outside a step (or cancellation at shutdown): nothing
        would serve the requests it holds, so they fail now and health turns red."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        logger.error("engine loop ended", exc_info=exc)
        self.failed = f"the engine loop ended: {type(exc).__name__}: {exc}"
        error = EngineError(f"the model replica failed: {self.failed}", status=503,
                            type_="ServiceUnavailableError", retry_after=RETRY_AFTER_S)
        for request_id in list(self._requests):
            self._fail(request_id, error)
        self._flush()

    def health(self) -> dict[str, Any]:
        """The truth for /health: the loop is alive, and no step has run for too long."""
        task = self._loop_task
        step_for = (time.monotonic() - self._step_started
                    if self._step_started is not None else 0.0)
        return {"failed": self.failed,
                "loop_alive": task is None or not task.done(),
                "step_running_s": step_for, "stalled": step_for > self.config.step_stall_s,
                "since_last_step_s": time.monotonic() - self.last_step_end}

    def _expire_waiting(self) -> None:
        """Fails requests the scheduler has not started by their deadline (503, Retry-After)."""
        if not self._deadlines:
            return
        now = time.monotonic()
        for request_id in [r for r, d in self._deadlines.items() if d <= now]:
            del self._deadlines[request_id]
            self.stats.rejected_queue_wait += 1
            self._fail(request_id, EngineError(
                "the server is overloaded: the request was not scheduled within the queue-wait "
                "limit; retry later", status=503, type_="ServiceUnavailableError",
                retry_after=RETRY_AFTER_S))

    def _flush(self) -> None:
        if self._outputs or self._errors:
            outputs, errors, self._outputs, self._errors = self._outputs, self._errors, [], []
            self.on_outputs(outputs, errors)

    async def _run(self) -> None:
        step: _Step | None = None  # in flight on the compute thread
        while True:
            self._flush()
            self._apply_stops()
            self._reap_aborted()
            self._expire_waiting()
            if step is None:
                if not self.scheduler.has_work():
                    self._flush()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                step = self._launch()
                if step is None:
                    await asyncio.sleep(0.001)
                    continue
            # async scheduling: the next step is scheduled and queued on the compute thread
            # while this one runs, so the loop's scheduling and postprocessing leave the path
            # between two forwards
            following = self._launch_ahead(step) if self.config.async_scheduling else None
            await self._finish(step, following is not None)
            step = following

    def _launch(self) -> _Step | None:
        """Schedules a step and queues it on the compute thread."""
        scheduled = self.scheduler.schedule()
        if self._deadlines:
            for s in scheduled:
                self._deadlines.pop(s.seq.request_id, None)
        if not scheduled:
            return None
        sampling = [s.seq for s in scheduled if s.samples]
        masks: concurrent.futures.Future = concurrent.futures.Future()
        step = _Step(scheduled, sampling, time.monotonic())
        step.work = asyncio.get_running_loop().run_in_executor(
            self.compute, self._compute_step, self._step_input(scheduled), sampling, masks)
        # the constraint masks of this step need only the tokens so far, so they are filled
        # here while the forward runs on the compute thread
        try:
            masks.set_result(self._fill_masks(sampling, step.row_errors))
        except Exception as exc:
            masks.set_exception(exc)
        if self._step_started is None:
            self._step_started = step.launched
        return step

    def _launch_ahead(self, step: _Step) -> _Step | None:
        """Schedules the step after `step` before its result is back, where every sequence in
        it allows that (`Sequence.schedules_ahead`): each is advanced as if its step were done,
        a sampled one by a placeholder token that the compute thread replaces with the token it
        sampled (`_resolve`) and `_postprocess` with the same token. A sequence whose length
        limit that token reaches is taken out of the running set, so no step is spent on it."""
        if not all(s.seq.schedules_ahead and s.seq.table_epoch == s.epoch
                   and not s.seq.is_finished for s in step.scheduled):
            return None
        for s in step.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if s.samples:
                seq.token_ids.append(PENDING)
                if ((seq.num_output_tokens >= seq.params.max_tokens
                     or len(seq) >= self.config.max_model_len) and seq in self.scheduler.running):
                    self.scheduler.running.remove(seq)  # _check_stop frees it
        step.advanced = True
        following = self._launch()
        if following is not None:
            self.stats.steps_scheduled_ahead += 1
        return following

    async def _finish(self, step: _Step, next_queued: bool) -> None:
        """Awaits a step's result and takes it in (or fails its requests)."""
        try:
            out, result, seconds = await step.work
            now = time.monotonic()
            self._step_started = now if next_queued else None
            self.last_step_end = now
            self._account(step.scheduled, seconds, out)
            self._postprocess(step, out, result)
        except Exception as exc:
            self._step_started = time.monotonic() if next_queued else None
            logger.exception("engine step failed")
            await self._on_step_failure(exc, step.scheduled)

    async def _on_step_failure(self, exc: Exception, scheduled: list[ScheduledSeq]) -> None:
        """A dead shard fails every request and the replica (Serve replaces it); anything else
        fails only the requests of the batch that hit it."""
        try:
            await asyncio.to_thread(self.executor.check_health)
        except Exception as health_exc:
            self.failed = f"{type(health_exc).__name__}: {health_exc}"
            error = EngineError(f"the model replica failed: {self.failed}", status=503,
                                type_="ServiceUnavailableError", retry_after=RETRY_AFTER_S)
            for request_id in list(self._requests):
                self._fail(request_id, error)
            return
        for s in scheduled:
            self._fail(s.seq.request_id, exc)

    def _reap_aborted(self) -> None:
        """Ends aborted requests. Each choice's output length is kept for a stop_choice still
        on its way: an ingress that cut a choice at a stop string cancels the call when the
        board's message has not ended it within STOP_DRAIN_S, so the abort can arrive first,
        and the tokens generated past the stop must still leave the counters. A choice in a
        step scheduled ahead is marked finished, so that step's token is not taken."""
        for request_id in self._aborted:
            for seq in self._requests.pop(request_id, []):
                if not seq.is_finished:
                    if seq.token_ids and seq.token_ids[-1] == PENDING:
                        seq.token_ids.pop()
                    seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
                self.scheduler.remove(seq)
                self._keep_length(seq)
            self._deadlines.pop(request_id, None)
        self._aborted.clear()

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self._deadlines.pop(request_id, None)
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return
        for seq in seqs:
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                self.scheduler.remove(seq)
        self._errors.append((request_id, exc))

    def _step_input(self, scheduled: list[ScheduledSeq]) -> StepInput:
        # a table emptied since it was sent (finished, aborted, preempted) is dropped by the
        # runners; a preempted sequence's new table is then sent whole
        freed = [seq_id for seq_id, (seq, epoch, _) in self._shipped.items()
                 if seq.table_epoch != epoch]
        for seq_id in freed:
            del self._shipped[seq_id]
        rows = []
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            shipped = self._shipped.get(seq.seq_id)
            sent = 0 if shipped is None else shipped[2]
            rows.append(RowInput(tuple(seq.token_ids[start:start + s.num_new_tokens]), start,
                                 tuple(seq.block_table[sent:]), s.samples,
                                 (seq.prompt_logprobs is not None
                                  and start < seq.num_prompt_tokens) or bool(seq.proposed),
                                 _encoder_slices(seq, start, start + s.num_new_tokens),
                                 _mrope_positions(seq, start, start + s.num_new_tokens),
                                 seq.seq_id))
            self._shipped[seq.seq_id] = (seq, seq.table_epoch, len(seq.block_table))
        return StepInput(tuple(rows), tuple(freed))

    def _account(self, scheduled: list[ScheduledSeq], seconds: float, out: StepOutput) -> None:
        self.stats.encoder_items += out.encoded
        self.stats.encoder_s += out.encoder_s
        self.stats.encoder_cache_hits += out.encoder_hits
        if all(s.num_new_tokens == 1 for s in scheduled):
            self.stats.decode_steps += 1
            self.stats.decode_step_s += seconds
        else:
            self.stats.prefill_steps += 1
            self.stats.prefill_step_s += seconds

    def _compute_step(self, step: StepInput, sampling: list[Sequence],
                      masks: concurrent.futures.Future
                      ) -> tuple[StepOutput, SamplerOutput | None, float]:
        """Forward and sampling, on the compute thread; returns their result and the seconds
        they took: the step's own time, not until the loop takes it in (under async scheduling
        the loop is then busy with the step before: on an H200 the engine scheduling ahead
        read 11-12 ms a decode step at 256 rows, where the sync core's steps took 3.7). All of
        the engine's torch work runs on that one thread: torch ops issued from a second thread
        bring up a second OpenMP team whose spinning threads slowed the forward by a third
        here."""
        started = time.perf_counter()
        sampled, self._sampled = self._sampled, {}  # (kept only until the next step)
        out = self.executor.execute(self._resolve(step, sampled))
        bitmask = masks.result()
        if not sampling:
            return out, None, time.perf_counter() - started
        if self.config.sampleable_vocab is not None:
            out.logits[:, self.config.sampleable_vocab:] = float("-inf")
        apply = None
        if bitmask is not None:
            words, rows = bitmask
            apply = lambda logits: _apply_bitmask(logits, words, rows)  # noqa: E731
        batch = self.sampling_batch.params(sampling, out.logits.shape[1], out.logits.device)
        result = sample(out.logits, sampling, self.eos_ids, apply, batch)
        self._sampled = {seq.seq_id: token for seq, token in zip(sampling, result.token_ids)}
        return out, result, time.perf_counter() - started

    @staticmethod
    def _resolve(step: StepInput, sampled: dict[int, int]) -> StepInput:
        """A row scheduled ahead ends in the placeholder of the token its sequence's previous
        step sampled: the token, from `sampled` (that step's, the one before this on the
        compute thread)."""
        if not any(row.token_ids[-1] == PENDING for row in step.rows):
            return step
        rows = []
        for row in step.rows:
            if row.token_ids[-1] == PENDING:
                token = sampled.get(row.seq_id)  # type: ignore[arg-type]
                if token is None:
                    raise EngineError("the engine step before this one failed", status=503,
                                      type_="ServiceUnavailableError",
                                      retry_after=RETRY_AFTER_S)
                row = row._replace(token_ids=(*row.token_ids[:-1], token))
            rows.append(row)
        return dataclasses.replace(step, rows=tuple(rows))

    def _fill_masks(self, sampling: list[Sequence], errors: dict[int, EngineError]
                    ) -> tuple[torch.Tensor, list[int]] | None:
        """A guide that fails here fails its own request (`errors`), not the step."""
        rows = [i for i, seq in enumerate(sampling) if seq.guide is not None and seq.guide_active]
        if not rows:
            return None
        bitmask = bitmask_lib.allocate(len(sampling), sampling[rows[0]].guide.vocab.size)
        filled = []
        for i in rows:
            try:
                sampling[i].guide.fill_bitmask(bitmask, i)
                filled.append(i)
            except Exception as exc:
                logger.exception("constraint guide failed for %s", sampling[i].request_id)
                errors[sampling[i].seq_id] = _internal_error("output constraint", exc)
        return (bitmask, filled) if filled else None

    def _postprocess(self, step: _Step, out: StepOutput, result: SamplerOutput | None) -> None:
        """Takes a step's result in. A sequence that left the running set since the step was
        scheduled (finished, aborted, preempted: possible when the next step was scheduled
        ahead) keeps no blocks of it; a preempted one still takes its sampled token."""
        self.stats.num_steps += 1
        # seq_id -> (logits that verify its draft, its computed tokens before this step)
        drafts: dict[int, tuple[torch.Tensor, int]] = {}
        dropped: set[int] = set()  # drafts taken back: nothing of theirs was sampled
        advanced, commit = step.advanced, self.blocks.commit_full_blocks
        for s, all_logits in zip(step.scheduled, out.all_logits):
            seq = s.seq
            before = s.before
            if before < seq.num_prompt_tokens:
                self.stats.prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - before)
            if seq.is_finished or seq.table_epoch != s.epoch:
                continue
            if not advanced:
                seq.num_computed_tokens += s.num_new_tokens
            if seq.proposed:
                if s.samples and all_logits is not None:
                    # from the position of the token before the draft: blocks are committed
                    # once it is known which draft tokens stay
                    drafts[seq.seq_id] = (
                        all_logits[len(seq) - len(seq.proposed) - 1 - before:], before)
                    continue
                self._drop_draft(seq)  # only part of it fitted this step's budget
                dropped.add(seq.seq_id)
            commit(seq, before)
            if all_logits is not None and seq.prompt_logprobs is not None:
                self._prompt_logprobs(seq, before, all_logits)
        if result is None:
            return
        aborted, row_errors = self._aborted, step.row_errors
        failed, masked_out = result.failed, result.masked_out
        for row, (seq, token, lp) in enumerate(zip(step.sampling, result.token_ids,
                                                   result.logprobs)):
            if seq.request_id in aborted or seq.is_finished or seq.seq_id in dropped:
                continue
            if row_errors or failed or masked_out:
                error = row_errors.get(seq.seq_id)
                if row in failed:
                    error = EngineError(failed[row], param="logits_processors")
                if error is not None:
                    self._fail(seq.request_id, error)
                    continue
                if row in masked_out:
                    self._end_masked_out(seq)
                    continue
            try:
                self._take_sampled(seq, token, lp, drafts, advanced)
            except Exception as exc:  # this row's guide or draft: its request fails, not the step
                logger.exception("sampled token of %s failed", seq.request_id)
                self._fail(seq.request_id, _internal_error("sampled token", exc))

    def _take_sampled(self, seq: Sequence, token: int, lp: TokenLogprob | None,
                      drafts: dict[int, tuple[torch.Tensor, int]], advanced: bool) -> None:
        """`advanced`: the sequence holds the token's placeholder already (`_launch_ahead`)."""
        new: list[int] = []
        if drafts and seq.seq_id in drafts:
            new, token = self._verify_draft(seq, *drafts[seq.seq_id], token)
        if not seq.is_finished:
            if advanced:
                if seq.token_ids[-1] != PENDING:
                    raise RuntimeError("a sequence scheduled ahead lost its placeholder")
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            new.append(token)
            if seq.guide is not None:
                new += self._advance_guide(seq, token)
            self._check_stop(seq, token)
        self.stats.generation_tokens += len(new)  # every output token, as usage
        self._emit(seq, tuple(new), lp)
        if not seq.is_finished and prediction.can_predict(seq):
            room = min(seq.params.max_tokens - seq.num_output_tokens,
                       self.config.max_model_len - len(seq)) - 1
            seq.proposed = prediction.propose(seq, room)
            seq.token_ids.extend(seq.proposed)

    def _drop_draft(self, seq: Sequence) -> None:
        """Takes a draft back unverified: the tokens leave the sequence, and the position
        before them is computed again (with its logits) in the next step."""
        del seq.token_ids[len(seq) - len(seq.proposed):]
        seq.proposed = []
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq) - 1)

    def _verify_draft(self, seq: Sequence, logits: torch.Tensor, before: int,
                      sampled: int) -> tuple[list[int], int]:
        """Keeps the draft tokens the model agrees with (up to a stop rule they meet); returns
        them and the token that follows (the sampler's own when all are kept). Only the kept
        ones' KV stays computed, and only their blocks enter the prefix cache."""
        draft, seq.proposed = seq.proposed, []
        agreed, replacement = prediction.verify(seq, logits, draft)
        base = len(seq) - len(draft)
        del seq.token_ids[base:]
        kept: list[int] = []
        for t in draft[:agreed]:
            seq.token_ids.append(t)
            kept.append(t)
            self._check_stop(seq, t)
            if seq.is_finished:
                break
        if not seq.is_finished:  # (a finished one's blocks are gone already)
            seq.num_computed_tokens = len(seq)
            self.blocks.commit_full_blocks(seq, before)
        seq.accepted_prediction += len(kept)
        seq.rejected_prediction += len(draft) - agreed
        seq.prediction_pos += agreed + 1  # where the output is expected to go on in it
        return kept, sampled if replacement is None else replacement

    def _end_masked_out(self, seq: Sequence) -> None:
        """Every token was masked for this row (say, a constraint whose next tokens the
        request's allowed_token_ids or bad_words forbid): the output ends, saying why."""
        seq.finish_reason = "abort"
        seq.stop_reason = ("no token is allowed here: the output constraint, allowed_token_ids, "
                           "bad_words, logit_bias and logits processors together mask them all")
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)
        self._emit(seq, (), None)

    def _advance_guide(self, seq: Sequence, token: int) -> list[int]:
        """Moves the constraint past `token`; returns the tokens it then forces (jump-forward),
        already appended to the sequence, which the scheduler computes like prompt tokens."""
        guide = seq.guide
        if not seq.guide_active:
            seq.guide_active = token == seq.constraint_after
            return []
        if token in self.eos_ids:
            seq.finish_reason = "stop"  # a guide never advances on EOS: it is the end
            return []
        try:
            guide.advance(token)
        except ValueError:  # a token the mask forbade: only a bug gets here; end this output
            logger.exception("constrained sequence %s sampled a forbidden token", seq.request_id)
            seq.finish_reason = "stop"
            return []
        forced: list[int] = []
        room = seq.params.max_tokens - seq.num_output_tokens
        if (seq.params.logprobs is None and room > 0 and not seq.params.masks_tokens
                and not seq.logits_processors and not guide.can_only_finish()):
            forced = guide.forced_tokens(room)
            if forced:
                guide.advance_many(forced)
                seq.token_ids.extend(forced)
                self.stats.forced_tokens += len(forced)
        if guide.can_only_finish():
            seq.finish_reason = "stop"
        return forced

    def _prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        # logits at position p score the token at p + 1; the first prompt token has none.
        # A preempted sequence computes its prompt again: positions it has entries for already
        # are skipped, so each prompt token gets exactly one
        done = len(seq.prompt_logprobs) - 1  # type: ignore[arg-type]
        first = max(start, done)
        end = min(start + logits.shape[0], seq.num_prompt_tokens - 1)
        if end <= first:
            return
        targets = torch.tensor(seq.token_ids[first + 1:end + 1])
        k = seq.params.prompt_logprobs or 0
        rows = logits[first - start: end - start]
        seq.prompt_logprobs.extend(  # type: ignore[union-attr]
            compute_logprobs(rows, targets, [k] * len(targets)))

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        length = len(seq.token_ids)  # every sampled row, every step: read once, no properties
        out = length - seq.num_prompt_tokens
        # a finish_reason already set means the constraint ended the output
        if seq.finish_reason is None and out >= p.min_tokens:
            if token in self.eos_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif token in p.stop_token_set:
                seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is None and (out >= p.max_tokens
                                          or length >= self.config.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
            self.scheduler.remove(seq)

    def _keep_length(self, seq: Sequence) -> None:
        """An ended choice's output length, for a stop_choice that may still come for it."""
        self._finished_lengths[(seq.request_id, seq.choice_index)] = seq.num_output_tokens
        if len(self._finished_lengths) > FINISHED_LENGTHS_KEPT:
            self._finished_lengths.popitem(last=False)

    def _emit(self, seq: Sequence, tokens: tuple[int, ...], lp: TokenLogprob | None) -> None:
        if seq.request_id not in self._requests:
            return
        first = seq.num_output_tokens == len(tokens)
        accepted, rejected = seq.accepted_prediction, seq.rejected_prediction
        self._outputs.append((seq.request_id, TokenBatch(
            seq.choice_index, tokens, None if lp is None else (lp,), seq.finish_reason,
            seq.stop_reason, seq.num_prompt_tokens, seq.num_cached_tokens if first else 0,
            tuple(seq.prompt_logprobs) if first and seq.prompt_logprobs is not None else None,
            None, accepted, rejected)))
        if accepted or rejected:
            seq.accepted_prediction = seq.rejected_prediction = 0
        if seq.is_finished:
            self._keep_length(seq)
            seqs = self._requests.get(seq.request_id, [])
            if all(s.is_finished for s in seqs):
                self._requests.pop(seq.request_id, None)
                self._deadlines.pop(seq.request_id, None)
