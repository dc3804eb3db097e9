"""Batched sampling: one set of tensor operations per step for all rows.

Order, as in vLLM: logprobs of the raw logits; then constraint bitmasks, allowed-token masks, bad
words, min-tokens EOS bans, logit bias, repetition/presence/frequency penalties, temperature,
min-p; then one inverse-transform draw (a uniform a row against the running sum of its
probabilities) draws every row at once, top-k and top-p sets cut in a window of the largest
logits or, where they spread wider, drawn by rejection; on CPUs with the native kernels that draw
is one call (kernels.draw), in torch elsewhere. Seeded rows draw their uniforms from
their own generator, so a seed gives the same tokens whatever else shares the batch.

A request's lists (allowed_token_ids, logit_bias, bad words, stop_token_ids) become tensors once,
on its sequence's first step (`RowTables`), so a step costs a few tensor operations per row that
has them, whatever their lengths: every row of the batch waits for the step.

The logits may live on the GPU (an in-process worker leaves them there): every tensor here is made
on the logits' device and branch decisions are taken from the requests' parameters in Python, so
a step syncs with the device once, for the chosen tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from replicas import kernels
from replicas.host_tensors import int64
from replicas.request import SamplingParams, Sequence, TokenLogprob
from replicas.sampling_batch import BatchParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # rows whose every token the constraint, the request's lists or its logits processors
    # masked: nothing can be sampled there (their token_ids entry means nothing)
    masked_out: frozenset[int] = frozenset()
    # row -> why its own work failed (a logits processor raised or returned a wrong row): that
    # row's request fails, the others' tokens stand
    failed: dict[int, str] = field(default_factory=dict)


def _padded_ids(rows: list[list[int]], pad: Callable[[list[int]], int],
                device: torch.device) -> torch.Tensor:
    """[len(rows), longest] int64: each row's ids, then `pad(row)` to the longest. Filled
    through numpy: torch.tensor over the nested lists took 1.0-1.6 ms for 32 rows of 130-260
    ids, this 0.12 (2-core Zen 4)."""
    width = max((len(r) for r in rows), default=0)
    ids = np.empty((len(rows), width), np.int64)
    for j, r in enumerate(rows):
        ids[j, :len(r)] = r
        ids[j, len(r):] = pad(r)
    return torch.from_numpy(ids).to(device)


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    if not any(rows):
        return counts[:, :vocab]
    ids = _padded_ids(rows, lambda r: vocab, device)  # padded into a spare column
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), in one native pass a row on CPUs (kernels.argmax: torch's took 0.69 ms
    for 32 rows of a 49,152-token vocabulary, a greedy batch's whole sampling step)."""
    if kernels.supports_draw(logits):
        return kernels.argmax(logits)
    return logits.argmax(-1)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence],
                    batch: BatchParams | None = None) -> None:
    vocab, dev = logits.shape[1], logits.device
    batch = batch or BatchParams.of_seqs(seqs, vocab, dev)
    if kernels.supports_draw(logits) and logits.is_contiguous():
        # one native call over each row's seen tokens (kernels.penalize): the counts over the
        # whole vocabulary and the full-row passes below took 5-7 ms a step at 32 rows
        rows = len(seqs)
        kernels.penalize(
            logits, _padded_ids([s.token_ids for s in seqs], lambda r: -1, dev),
            torch.tensor([len(s.token_ids) for s in seqs]),
            torch.tensor([s.num_prompt_tokens for s in seqs]),
            batch.repetition if batch.repetition is not None else torch.ones(rows),
            batch.frequency if batch.frequency is not None else torch.zeros(rows),
            batch.presence if batch.presence is not None else torch.zeros(rows))
        return
    if batch.repetition is not None:
        # only the logits of tokens seen (prompt and output) change: gathered, scaled and
        # scattered back rather than a pass over every row's whole vocabulary (a model's
        # default penalty applies to every request; duplicates write the same value)
        repetition = batch.repetition.unsqueeze(1)
        # padded with a row's own first token: a duplicate writes the same value
        ids = _padded_ids([s.token_ids for s in seqs], lambda r: r[0], dev)
        seen = logits.gather(1, ids)
        logits.scatter_(1, ids, torch.where(seen > 0, seen / repetition, seen * repetition))
    if batch.presence is not None or batch.frequency is not None:
        out_counts = _token_counts([s.output_token_ids for s in seqs], vocab, dev)
        if batch.frequency is not None:
            logits -= batch.frequency.unsqueeze(1) * out_counts
        if batch.presence is not None:
            logits -= batch.presence.unsqueeze(1) * (out_counts > 0)


class BadWordPrefixes:
    """Multi-token bad words keyed by their prefixes read backwards from the newest token: a step
    walks back only while some prefix still matches the output's tail (most steps: one lookup),
    so the cost does not grow with the number of words."""

    __slots__ = ("children", "banned")

    def __init__(self) -> None:
        self.children: dict[int, BadWordPrefixes] = {}
        self.banned: list[int] = []  # last tokens of the words whose prefix ends here

    def add(self, word: tuple[int, ...]) -> None:
        node = self
        for token in reversed(word[:-1]):
            node = node.children.setdefault(token, BadWordPrefixes())
        node.banned.append(word[-1])

    def banned_after(self, token_ids: list[int], num_output: int) -> list[int]:
        """The tokens that would complete a bad word after the output's last `num_output`
        tokens (a word's prefix must lie within the output, as in vLLM)."""
        out: list[int] = []
        node: BadWordPrefixes | None = self
        for back in range(1, num_output + 1):
            node = node.children.get(token_ids[-back])
            if node is None:
                break
            out.extend(node.banned)
        return out


@dataclass(frozen=True)
class RowTables:
    """One sequence's per-request lists as the sampler applies them, on the logits' device: the
    fixed ones folded into one dense row that a step adds (a vectorised add of V floats costs
    the same whether a request sends one entry or the caps' thousands)."""

    # [V]: -inf where allowed_token_ids leaves a token out or a single-token bad word bans it,
    # the logit_bias elsewhere (a bias on a banned token leaves it at -inf)
    fixed: torch.Tensor | None = None
    early_stops: torch.Tensor | None = None  # [V]: -inf at EOS and stop_token_ids (min_tokens)
    prefixes: BadWordPrefixes | None = None  # multi-token bad words

    @property
    def empty(self) -> bool:
        return self.fixed is None and self.early_stops is None and self.prefixes is None

    @classmethod
    def build(cls, p: SamplingParams, eos_ids: frozenset[int], vocab: int,
              device: torch.device) -> RowTables:
        fixed = None
        single = [w[0] for w in p.bad_words_token_ids if len(w) == 1]
        if p.allowed_token_ids is not None or p.logit_bias or single:
            fixed = torch.zeros(vocab)
            if p.logit_bias:
                fixed.index_add_(0, int64(t for t, _ in p.logit_bias),  # repeats add up
                                 torch.tensor([b for _, b in p.logit_bias]))
            if p.allowed_token_ids is not None:
                disallowed = torch.ones(vocab, dtype=torch.bool)
                disallowed[int64(p.allowed_token_ids)] = False
                fixed.masked_fill_(disallowed, _NEG_INF)
            if single:
                fixed[int64(single)] = _NEG_INF
            fixed = fixed.to(device)
        prefixes = None
        for word in p.bad_words_token_ids:
            if len(word) > 1:
                prefixes = prefixes or BadWordPrefixes()
                prefixes.add(word)
        early_stops = None
        if p.min_tokens > 0:
            early_stops = torch.zeros(vocab)
            early_stops[int64(sorted({*eos_ids, *p.stop_token_ids}))] = _NEG_INF
            early_stops = early_stops.to(device)
        return cls(fixed, early_stops, prefixes)


def tables_of(s: Sequence, eos_ids: frozenset[int], vocab: int,
              device: torch.device) -> RowTables:
    if s.sampling_tables is None:
        s.sampling_tables = RowTables.build(s.params, eos_ids, vocab, device)
    return s.sampling_tables


def _request_lists(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int],
                   failed: dict[int, str]) -> None:
    """allowed_token_ids, bad words, min_tokens' bans of EOS and stop_token_ids, logit_bias."""
    vocab, dev = logits.shape[1], logits.device
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(seqs):
        try:
            t = tables_of(s, eos_ids, vocab, dev)
        except Exception as exc:  # (say, a token id past this model's vocabulary)
            failed[i] = f"the request's token lists cannot apply: {type(exc).__name__}: {exc}"
            continue
        if t.empty:
            continue
        row = logits[i]
        if t.fixed is not None:
            row += t.fixed
        if t.early_stops is not None and s.num_output_tokens < s.params.min_tokens:
            row += t.early_stops
        if t.prefixes is not None:
            banned = t.prefixes.banned_after(s.token_ids, s.num_output_tokens)
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if rows:
        logits[rows, cols] = _NEG_INF


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence],
                      batch: BatchParams | None = None) -> torch.Tensor:
    """The logits with every token outside each row's min-p, top-k and top-p sets at -inf (for
    a draft's probabilities, replicas/prediction.py; the sampler draws from those sets without
    building them, `_draw_truncated`)."""
    vocab, dev = logits.shape[1], logits.device
    batch = batch or BatchParams.of_seqs(seqs, vocab, dev)
    k, p = batch.top_k, batch.top_p
    if batch.min_p is not None:
        logits = _min_p(logits, batch.min_p)
    rows = [i for i in range(len(seqs)) if k[i] < vocab or p[i] < 1.0]
    if rows:
        part = logits[rows] if len(rows) < len(seqs) else logits
        part, _ = _truncate(part, [k[i] for i in rows], [p[i] for i in rows])
        if len(rows) < len(seqs):
            logits = logits.clone()
            logits[rows] = part
        else:
            logits = part
    return logits


FIRST_CANDIDATES = 64


def _window(logits: torch.Tensor, k: list[int], p: list[float], widen: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's top_k and top_p set (top_p over the whole row's probabilities, keeping at least
    one token) as a full descending sort would find it, but over the row's largest logits only:
    a window of the largest top_k or 64, widened 4x while some row's top_p mass is not yet
    reached inside it (with `widen` False the first window is all there is). Sorting 49,152
    logits a row cost ~1 ms a row a step on CPUs; sampled text puts its top_p mass in a few
    dozen tokens. Returns, per row over the window: the logits, descending, their token ids,
    their probabilities in the whole row, which of them are outside the set, and whether the
    row's set lies inside the window."""
    vocab, dev = logits.shape[1], logits.device
    top_k = torch.tensor(k, device=dev).clamp(min=1).unsqueeze(1)
    top_p = torch.tensor(p, device=dev).unsqueeze(1)
    # the row's probabilities in log space, of which the window's are gathered: torch's CPU
    # logsumexp (the same from values - logsumexp) took 4-5x log_softmax's time on a
    # low-temperature row, whose exponents underflow (49,152 logits at temperature 0.2: 1 row
    # 204 against 51 us, 32 rows 3.6 against 0.79 ms; 2-core Zen 4), and was the less exact
    log_probs = logits.log_softmax(-1)
    width = min(vocab, max(FIRST_CANDIDATES, max(x + 1 for x in k if x < vocab)
                           if any(x < vocab for x in k) else 0))
    while True:
        values, order = (kernels.topk(logits, width) if kernels.supports_topk(logits, width)
                         else logits.topk(width, dim=-1))
        probs = log_probs.gather(1, order).exp()
        ranks = torch.arange(width, device=dev).unsqueeze(0)
        # drop a token when the tokens ranked above it already reach top_p
        cut = (ranks >= top_k) | ((probs.cumsum(-1) - probs) >= top_p)
        # a row whose last candidate is cut: nothing past the window survives either
        reached = cut[:, -1]
        if width == vocab or bool(reached.all()) or not widen:
            break
        width = min(vocab, width * 4)
    closed = torch.ones_like(reached) if width == vocab else reached
    return values, order, probs, cut, closed


def _truncate(logits: torch.Tensor, k: list[int], p: list[float], widen: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's logits outside its top_k and top_p set (`_window`) set to -inf. With `widen`
    False the second value marks the rows whose set reaches past the first window (their first
    value's row is not their set); else it is None."""
    values, order, _, cut, closed = _window(logits, k, p, widen)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, order, values.masked_fill(cut, _NEG_INF))
    return out, (None if widen or bool(closed.all()) else ~closed)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     top_n: list[int]) -> list[TokenLogprob]:
    """logits: [R, V], raw (before penalties, temperature and masks); token_ids: [R]; top_n[i]
    top alternatives for row i. On CPUs in native passes (kernels.logprobs: torch's
    log_softmax, compare-and-sum and topk took 3-12 ms a step for 32 rows)."""
    k = max(top_n, default=0)
    top_vals = top_ids = None
    if kernels.supports_logprobs(logits, k):
        chosen, ranks, top_vals, top_ids = kernels.logprobs(logits, token_ids.cpu(), k)
    else:
        raw_logprobs = logits.log_softmax(-1)
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = (raw_logprobs > chosen.unsqueeze(1)).sum(1) + 1
        if k:
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
    # to Python lists in one go: per-element reads of a GPU tensor would each sync, and a
    # slice's tolist a row cost ~5 us each (0.3 ms a step at 32 rows)
    ids, values = (top_ids.tolist(), top_vals.tolist()) if k else ([], [])
    return [TokenLogprob(token, value, rank, tuple(zip(ids[i][:n], values[i][:n])) if n else ())
            for i, (token, value, rank, n) in enumerate(zip(token_ids.tolist(), chosen.tolist(),
                                                            ranks.tolist(), top_n))]


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int],
           bitmask_fn=None, batch: BatchParams | None = None) -> SamplerOutput:
    """logits: [B, V] float32 for the rows in `seqs` (in that order); modified in place.
    `bitmask_fn(logits)` applies constraint masks when any row is constrained; `batch`: the
    rows' parameters as tensors (`SamplingBatch.params`), else built here."""
    batch = batch or BatchParams.of_seqs(seqs, logits.shape[1], logits.device)
    # the rows whose logprobs are asked for, as the model gave them (the rest modifies logits);
    # index_select: indexing by a list took 0.89 ms for 32 rows of 49,152 logits, this 0.19
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    raw = logits.index_select(0, torch.tensor(want, device=logits.device)) if want else None
    if bitmask_fn is not None:
        bitmask_fn(logits)
    failed: dict[int, str] = {}
    _request_lists(logits, seqs, eos_ids, failed)
    for i, s in enumerate(seqs):
        if s.logits_processors:
            _run_processors(logits, i, s, failed)
    masked_out: frozenset[int] = frozenset()
    if bitmask_fn is not None or any(s.sampling_tables is not None and not s.sampling_tables.empty
                                     or s.logits_processors for s in seqs):
        # a row with nothing left would sample NaNs (argmax: token 0): it is reported instead
        dead = torch.isneginf(logits).all(-1)
        if bool(dead.any()):
            masked_out = frozenset(dead.nonzero().flatten().tolist())
    if (batch.repetition is not None or batch.presence is not None
            or batch.frequency is not None):
        apply_penalties(logits, seqs, batch)

    greedy = batch.greedy
    if batch.all_greedy:
        tokens = greedy_tokens(logits)
    else:
        best = greedy_tokens(logits) if any(greedy) else None
        scaled = logits.div_(batch.temperature.unsqueeze(1))
        if batch.min_p is not None and not kernels.supports_draw(scaled):
            scaled = _min_p(scaled, batch.min_p)  # (the native draw applies it in its passes)
        tokens = _draw(scaled, seqs, batch)
        if best is not None:
            tokens = torch.where(torch.tensor(greedy, device=logits.device), best, tokens)

    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if raw is not None:
        computed = compute_logprobs(raw, tokens[want], [seqs[i].params.logprobs or 0 for i in want])
        for i, lp in zip(want, computed):
            logprobs[i] = lp
    return SamplerOutput(tokens.tolist(), logprobs, masked_out - failed.keys(), failed)


class _Uniforms:
    """u ~ U[0, 1) for given rows of the step: a seeded row's from its own generator, on the
    host, so a seed gives the same tokens whatever shares the batch; the others' from torch's."""

    def __init__(self, seqs: list[Sequence], greedy: tuple[bool, ...],
                 device: torch.device) -> None:
        self.seeded = {i: s.generator for i, s in enumerate(seqs)
                       if s.generator is not None and not greedy[i]}
        self.device = device

    def __call__(self, rows: list[int]) -> torch.Tensor:
        u = torch.rand(len(rows), 1, device=self.device)
        if self.seeded:
            for j, i in enumerate(rows):
                generator = self.seeded.get(i)
                if generator is not None:
                    u[j] = torch.rand(1, generator=generator).to(self.device)
        return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's first token whose running sum of probabilities passes u times the row's total
    (`probs` is overwritten). A token of probability 0 is never drawn: the running sum does not
    pass anything at it."""
    cdf = probs.cumsum_(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(
        max=probs.shape[1] - 1)


# a row still outside its top-k / top-p set after this many draws has its set built exactly
MAX_REJECTIONS = 16


def _draw(logits: torch.Tensor, seqs: list[Sequence], batch: BatchParams) -> torch.Tensor:
    """One token a row by inverse transform, one uniform a row, where the exponential race drew
    one random per vocabulary entry (at 32 rows of a 49,152-token vocabulary its 1.6M uniforms,
    logs, divisions and argmax were 16 ms a step on a CPU). Rows with top-k or top-p draw from
    their sets: inside the first window of their largest logits (`_window`) where the set lies
    inside it, in the window's order, so no pass over the vocabulary follows (softmax, running
    sum and search over 32 x 49,152 logits were ~1.5 ms a step on 2 cores); else by rejection
    (`_draw_truncated`); the window widened to the whole row (a sort) took 7-100 ms a step for
    32 rows whose top_p mass spreads wide."""
    rows = list(range(len(seqs)))
    uniforms = _Uniforms(seqs, batch.greedy, logits.device)
    if kernels.supports_draw(logits):
        return _draw_native(logits, rows, batch, uniforms)
    vocab = logits.shape[1]
    truncated = [i for i in rows if not batch.greedy[i]
                 and (batch.top_k[i] < vocab or batch.top_p[i] < 1.0)]
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    inside: list[int] = []  # rows drawn inside their window
    wide: list[int] = []  # rows whose set reaches past it: whole rows, the rejection's first draw
    if truncated:
        part = logits if len(truncated) == len(rows) else logits[truncated]
        _, order, probs, cut, closed = _window(part, [batch.top_k[i] for i in truncated],
                                               [batch.top_p[i] for i in truncated], widen=False)
        flags = closed.tolist()
        inside = [i for i, f in zip(truncated, flags) if f]
        wide = [i for i, f in zip(truncated, flags) if not f]
        if inside:
            kept = probs.masked_fill_(cut, 0.0)
            if wide:
                at = torch.tensor([j for j, f in enumerate(flags) if f], device=logits.device)
                kept, order = kept[at], order[at]
            drawn = _inverse_cdf(kept, uniforms(inside))
            tokens[inside] = order.gather(1, drawn.unsqueeze(1)).squeeze(1)
    drawn_inside = set(inside)
    rest = [i for i in rows if i not in drawn_inside] if inside else rows
    if rest:
        probs = (logits if len(rest) == len(rows) else logits[rest]).softmax(-1)
        wide_probs = None
        if wide:  # taken before the draw overwrites them
            at_rest = {r: j for j, r in enumerate(rest)}
            wide_probs = probs[[at_rest[i] for i in wide]]
        tokens[rest] = _inverse_cdf(probs, uniforms(rest))
        if wide_probs is not None:
            tokens[wide] = _draw_truncated(wide_probs, tokens[wide], wide, batch, uniforms)
    return tokens


def _draw_native(logits: torch.Tensor, rows: list[int], batch: BatchParams,
                 uniforms: _Uniforms) -> torch.Tensor:
    """`_draw` in native calls on CPUs, min_p included (kernels.draw: each row's window,
    probabilities and search without a tensor operation between them): ~15 torch operations
    took ~0.4 ms for one row of a 49,152-token vocabulary, and `_min_p`'s passes over the rows
    another ~2.6 ms a step at 32 rows. Rows whose set reaches past their window draw by rejection as
    `_draw_truncated` does, a round a call (kernels.redraw), with the same uniforms: its tensor
    operations over whole rows took 10-16 ms a step for 32 such rows."""
    logits = logits.contiguous()
    top_k = torch.tensor(batch.top_k).clamp_(min=1)
    top_p = torch.tensor(batch.top_p)
    min_p = batch.min_p if batch.min_p is not None else torch.zeros(len(rows))
    tokens, kept = kernels.draw(logits, top_k, top_p, min_p, uniforms(rows).squeeze(1),
                                FIRST_CANDIDATES)
    pending = (~kept).nonzero().flatten()
    for _ in range(MAX_REJECTIONS):
        if not pending.numel():
            return tokens
        drawn, kept = kernels.redraw(logits, pending, tokens[pending], top_k[pending],
                                     top_p[pending], min_p[pending],
                                     uniforms(pending.tolist()).squeeze(1))
        tokens[pending] = drawn
        pending = pending[~kept]
    if pending.numel():
        left = logits[pending]
        if batch.min_p is not None:
            left = _min_p(left, batch.min_p[pending])
        tokens[pending] = _draw_exact(left, pending.tolist(), batch, uniforms)
    return tokens


def _draw_exact(logits: torch.Tensor, rows: list[int], batch: BatchParams,
                uniforms: _Uniforms) -> torch.Tensor:
    """Rows still outside their sets after MAX_REJECTIONS draws (`logits`: theirs, in `rows`'
    order): each set built exactly, by a sort."""
    kept, _ = _truncate(logits, [batch.top_k[i] for i in rows], [batch.top_p[i] for i in rows])
    return _inverse_cdf(kept.softmax(-1), uniforms(rows))


def _draw_truncated(probs: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                    batch: BatchParams, uniforms: _Uniforms) -> torch.Tensor:
    """Draws from each row's top-k and top-p set without building it, from `tokens` drawn from
    the rows' whole `probs` (both overwritten): a drawn token is kept
    when fewer than top_k tokens, holding less than top_p of the probability, are more likely
    than it; otherwise it and every token no more likely leave the row (none of them can be in
    the set) and the row draws again from what is left. That is rejection sampling, so the
    kept token follows the row's probabilities renormalised over its set, as a sort would
    give; a draw lands in the set with at least top_p's probability, and each miss drops the
    tail below it. Ties at the set's boundary are kept."""
    dev = probs.device
    top_k = torch.tensor([batch.top_k[i] for i in rows], device=dev)
    top_p = torch.tensor([batch.top_p[i] for i in rows], device=dev)
    original = probs.clone()
    pending = torch.arange(len(rows), device=dev)
    for _ in range(MAX_REJECTIONS):
        part = probs[pending]
        drawn = part.gather(1, tokens[pending].unsqueeze(1))
        above = part > drawn
        ok = ((above.sum(-1) < top_k[pending]) & ((part * above).sum(-1) < top_p[pending])
              | ~above.any(-1))  # the most likely token is always in the set
        miss = ~ok
        pending = pending[miss]
        if not pending.numel():
            return tokens
        part, drawn = part[miss], drawn[miss]
        part.masked_fill_(part <= drawn, 0.0)
        probs[pending] = part
        tokens[pending] = _inverse_cdf(part, uniforms([rows[i] for i in pending.tolist()]))
    tokens[pending] = _draw_exact(original[pending].log(), [rows[i] for i in pending.tolist()],
                                  batch, uniforms)
    return tokens


def _run_processors(logits: torch.Tensor, i: int, s: Sequence, failed: dict[int, str]) -> None:
    """A processor that raises or returns something other than a row of logits fails its own
    request: its row is neutralised so the batch samples on, and `failed` says why."""
    for processor in s.logits_processors:
        name = getattr(processor, "__name__", type(processor).__name__)
        try:
            row = processor(s.output_token_ids, logits[i])
            if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                raise TypeError(f"it returned {type(row).__name__}, not a tensor of shape "
                                f"{tuple(logits[i].shape)}")
            logits[i] = row
        except Exception as exc:
            failed[i] = f"logits processor {name} failed: {type(exc).__name__}: {exc}"
            logits[i] = 0.0
            return
