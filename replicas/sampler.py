"""Batched sampling: one set of tensor operations per step for all rows.

Order, as in vLLM: logprobs of the raw logits; then allowed-token masks, constraint bitmasks, bad
words, min-tokens EOS bans, logit bias, repetition/presence/frequency penalties, temperature,
min-p, top-k, top-p; then one exponential race (argmax of p / q with q ~ Exp(1)) draws every row
at once. Seeded rows draw their q from their own generator, so a seed gives the same tokens
whatever else shares the batch.

The logits may live on the GPU (an in-process worker leaves them there): every tensor here is made
on the logits' device and branch decisions are taken from the requests' parameters in Python, so
a step syncs with the device once, for the chosen tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.request import Sequence, TokenLogprob

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    # padded into a spare column
    ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab, dev = logits.shape[1], logits.device
    out_counts = _token_counts([list(s.output_token_ids) for s in seqs], vocab, dev)
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=dev).unsqueeze(1)
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev).unsqueeze(1)
    if any(s.params.repetition_penalty != 1.0 for s in seqs):
        repetition = torch.tensor([s.params.repetition_penalty for s in seqs],
                                  device=dev).unsqueeze(1)
        seen = _token_counts([list(s.token_ids) for s in seqs], vocab, dev) > 0
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency * out_counts + presence * (out_counts > 0)


def _ban_rows(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            for t in (*eos_ids, *p.stop_token_ids):
                rows.append(i)
                cols.append(t)
        out = s.output_token_ids
        for word in p.bad_words_token_ids:
            prefix = list(word[:-1])
            if not prefix or out[len(out) - len(prefix):] == prefix:
                rows.append(i)
                cols.append(word[-1])
    if rows:
        logits[rows, cols] = _NEG_INF


def _allowed_only(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for i, s in enumerate(seqs):
        allowed = s.params.allowed_token_ids
        if allowed is not None:
            keep = torch.full((logits.shape[1],), _NEG_INF, device=logits.device)
            keep[torch.tensor(list(allowed), device=logits.device)] = 0.0
            logits[i] += keep


def _logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for t, b in s.params.logit_bias:
            rows.append(i)
            cols.append(t)
            vals.append(b)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, device=dev), accumulate=True)


def _top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab, dev = logits.shape[1], logits.device
    k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    p = [s.params.top_p for s in seqs]
    if any(s.params.min_p > 0 for s in seqs):
        min_p = torch.tensor([s.params.min_p for s in seqs], device=dev)
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if any(x < vocab for x in k) or any(x < 1.0 for x in p):
        top_k, top_p = torch.tensor(k, device=dev), torch.tensor(p, device=dev)
        sorted_logits, order = logits.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        cut = ranks >= top_k.clamp(min=1).unsqueeze(1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (keeps at least one)
        cut |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, _NEG_INF)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def compute_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                     top_n: list[int]) -> list[TokenLogprob]:
    """raw_logprobs: [R, V]; token_ids: [R]; top_n[i] top alternatives for row i."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (raw_logprobs > chosen.unsqueeze(1)).sum(1) + 1
    k = max(top_n, default=0)
    top_vals, top_ids = (raw_logprobs.topk(k, dim=-1) if k else (None, None))
    # to the host in one go: per-element reads of a GPU tensor would each sync
    token_ids, chosen, ranks = token_ids.cpu(), chosen.cpu(), ranks.cpu()
    if k:
        top_vals, top_ids = top_vals.cpu(), top_ids.cpu()
    out = []
    for i, n in enumerate(top_n):
        top: tuple[tuple[int, float], ...] = ()
        if n:
            top = tuple(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
        out.append(TokenLogprob(int(token_ids[i]), float(chosen[i]), int(ranks[i]), top))
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int],
           bitmask_fn=None) -> SamplerOutput:
    """logits: [B, V] float32 for the rows in `seqs` (in that order); modified in place.
    `bitmask_fn(logits)` applies constraint masks when any row is constrained."""
    want_logprobs = [s.params.logprobs is not None for s in seqs]
    raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None
    _allowed_only(logits, seqs)
    if bitmask_fn is not None:
        bitmask_fn(logits)
    _ban_rows(logits, seqs, eos_ids)
    _logit_bias(logits, seqs)
    for i, s in enumerate(seqs):
        for processor in s.logits_processors:
            logits[i] = processor(s.output_token_ids, logits[i])
    if any(s.params.needs_penalties for s in seqs):
        apply_penalties(logits, seqs)

    dev = logits.device
    tokens = logits.argmax(-1)
    if not all(s.params.greedy for s in seqs):
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in seqs],
                             device=dev)
        scaled = _top_k_top_p_min_p(logits / temps.unsqueeze(1), seqs)
        probs = scaled.softmax(-1)
        # q ~ Exp(1) as -log(U): several times faster on CPU than Tensor.exponential_
        q = torch.rand_like(probs)
        for i, s in enumerate(seqs):
            if s.generator is not None and not s.params.greedy:
                # a seeded row draws on the host from its own generator: the same seed gives
                # the same draw whatever else shares the batch, on any device
                q[i] = torch.rand(q.shape[1], generator=s.generator).to(dev)
        q = q.log_().neg_()
        sampled = (probs / q).argmax(-1)
        tokens = torch.where(greedy, tokens, sampled)

    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if raw_logprobs is not None:
        rows = [i for i, w in enumerate(want_logprobs) if w]
        computed = compute_logprobs(raw_logprobs[rows], tokens[rows],
                                    [seqs[i].params.logprobs or 0 for i in rows])
        for i, lp in zip(rows, computed):
            logprobs[i] = lp
    return SamplerOutput(tokens.tolist(), logprobs)
