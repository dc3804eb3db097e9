"""The sampler's draws: right frequencies at a temperature, never a masked token, seeded rows
independent of their batch."""

from __future__ import annotations

import torch

from replicas.request import SamplingParams, Sequence
from replicas.sampler import sample


def _seqs(n: int, temperature: float = 1.0, seeds: list[int | None] | None = None
          ) -> list[Sequence]:
    seqs = [Sequence(i, f"r{i}", 0, [1], 1, SamplingParams(max_tokens=4, temperature=temperature))
            for i in range(n)]
    for s, seed in zip(seqs, seeds or []):
        if seed is not None:
            s.generator = torch.Generator().manual_seed(seed)
    return seqs


def _logits(rows: int, probs: dict[int, float], vocab: int = 300) -> torch.Tensor:
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, list(probs)] = torch.tensor(list(probs.values())).log()
    return logits


def test_frequencies_follow_the_tempered_probabilities() -> None:
    torch.manual_seed(0)
    rows = 20000
    for temperature, expected in ((1.0, [0.5, 0.3, 0.2]), (0.5, [0.25 / 0.38, 0.09 / 0.38,
                                                                0.04 / 0.38])):
        logits = _logits(rows, {7: 0.5, 8: 0.3, 299: 0.2})
        tokens = torch.tensor(sample(logits, _seqs(rows, temperature), frozenset()).token_ids)
        assert set(tokens.unique().tolist()) == {7, 8, 299}  # masked tokens never come
        counts = torch.bincount(tokens, minlength=300).float() / rows
        torch.testing.assert_close(counts[[7, 8, 299]], torch.tensor(expected), atol=0.015,
                                   rtol=0)


def test_a_seed_draws_the_same_token_whatever_shares_the_batch() -> None:
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1))
    alone = [sample(logits.clone(), _seqs(1, seeds=[s]), frozenset()).token_ids[0]
             for s in range(20)]
    seeds = [None, *range(20), *[None] * 19]
    batch = sample(logits.expand(40, -1).clone(), _seqs(40, seeds=seeds), frozenset()).token_ids
    assert batch[1:21] == alone
    assert len(set(alone)) > 5  # and the seeds do differ
