"""Predicted Outputs (OpenAI's `prediction`): the client's guess of the output, used as a
speculative draft that the target model itself verifies.

After each sampled token a sequence with a prediction proposes up to `MAX_PROPOSED` draft tokens:
where the output's last tokens occur in the prediction (the longest of its last `LOOKUP` tokens
that does, latest occurrence after the previous match first), the tokens that follow them there.
Proposed tokens are appended to the sequence and computed in the next step like prompt tokens,
with the logits of every position kept; `verify` then accepts the longest prefix the model
agrees with and adds the token the model picks after it, so a step yields 1 + accepted tokens.

Greedy rows accept a draft token when it is the argmax, so greedy output is the output without a
prediction. Sampled rows use speculative sampling with a point-mass draft: a token the processed
distribution p gives probability p(d) is accepted with probability p(d), and on rejection the
replacement is drawn from p with d removed, which leaves every output token distributed exactly
as p. The tokens of a prediction that the model rejected are counted
(`rejected_prediction_tokens`); accepted ones count as ordinary output."""

from __future__ import annotations

import torch

from replicas.request import Sequence
from replicas.sampler import greedy_tokens, top_k_top_p_min_p

MAX_PROPOSED = 8  # draft tokens verified in one step at most
LOOKUP = 4  # the most output tokens matched against the prediction to find where it resumes


def can_predict(seq: Sequence) -> bool:
    """Rows whose next token depends only on the logits and the sampling parameters: no
    constraint, no request lists, processors, penalties or logprobs (those are refused with a
    prediction, or would need every draft position processed as its own history)."""
    p = seq.params
    return (bool(seq.prediction) and seq.guide is None and not seq.logits_processors
            and not p.masks_tokens and not p.needs_penalties and p.logprobs is None)


def propose(seq: Sequence, room: int) -> list[int]:
    """The draft tokens to verify next (at most `room`): those that follow, in the prediction,
    the longest tail of the output found there."""
    out = seq.output_token_ids
    k = min(MAX_PROPOSED, room)
    if k <= 0 or not out:
        return []
    for n in range(min(LOOKUP, len(out)), 0, -1):
        end = _match_end(seq.prediction, out[-n:], seq.prediction_pos)
        if end is not None and end < len(seq.prediction):
            seq.prediction_pos = end
            return list(seq.prediction[end:end + k])
    return []


def _match_end(prediction: tuple[int, ...], tail: list[int], hint: int) -> int | None:
    """Where an occurrence of `tail` in the prediction ends: at `hint` (where the output was
    expected to be), else the nearest after it, else the nearest before."""
    n = len(tail)
    for end in (hint, *range(hint + 1, len(prediction) + 1), *range(hint - 1, n - 1, -1)):
        if n <= end <= len(prediction) and list(prediction[end - n:end]) == tail:
            return end
    return None


def verify(seq: Sequence, logits: torch.Tensor, draft: list[int]) -> tuple[int, int | None]:
    """`logits`: [len(draft) + 1, V], those of the position before each draft token and of the
    last one. Returns (how many draft tokens are accepted, the token that replaces the first
    rejected one), or (len(draft), None) when all are: the sampler's own token follows them."""
    k = len(draft)
    rows = logits[:k].float()
    targets = torch.tensor(draft, device=rows.device)
    if seq.params.greedy:
        best = greedy_tokens(rows)
        agree = (best == targets).tolist()
        accepted = agree.index(False) if False in agree else k
        return accepted, (None if accepted == k else int(best[accepted]))
    temperature = torch.full((k, 1), seq.params.temperature, device=rows.device)
    probs = top_k_top_p_min_p(rows / temperature, [seq] * k).softmax(-1)
    chosen = probs.gather(1, targets.unsqueeze(1)).squeeze(1).cpu()
    draws = torch.rand(k, generator=seq.generator) if seq.generator is not None else torch.rand(k)
    for j in range(k):
        if draws[j] >= chosen[j]:
            residual = probs[j].cpu().clone()
            residual[draft[j]] = 0.0
            if float(residual.sum()) <= 0.0:  # p put everything on the draft token
                continue
            return j, int(torch.multinomial(residual / residual.sum(), 1,
                                            generator=seq.generator))
    return k, None
