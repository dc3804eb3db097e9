"""Predicted Outputs' draft logic alone (replicas/prediction.py): where a prediction resumes,
and that verification keeps greedy output and the sampling distribution as they were."""

from __future__ import annotations

import collections

import torch

from replicas import prediction
from replicas.request import SamplingParams, Sequence


def _seq(output: list[int], guess: tuple[int, ...], params: SamplingParams,
         seed: int | None = None) -> Sequence:
    seq = Sequence(0, "r", 0, [1, 2] + output, 2, params)
    seq.prediction = guess
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def test_a_draft_is_what_follows_the_output_in_the_prediction() -> None:
    guess = (10, 11, 12, 13, 14, 15, 11, 12, 16)
    greedy = SamplingParams(max_tokens=50, temperature=0.0)
    assert prediction.propose(_seq([10, 11], guess, greedy), 3) == [12, 13, 14]
    # an edit: the output's last token alone is found again later on
    assert prediction.propose(_seq([10, 99, 15], guess, greedy), 8) == [11, 12, 16]
    # the longest tail wins: "11 12" after 15 resumes at 16, not at 13
    seq = _seq([15, 11, 12], guess, greedy)
    assert prediction.propose(seq, 8) == [16]
    assert prediction.propose(_seq([42], guess, greedy), 8) == []  # nowhere in it
    assert prediction.propose(_seq([10], guess, greedy), 0) == []  # no room left


def test_greedy_verification_keeps_the_argmax_prefix() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate((3, 4, 1, 2)):
        logits[row, best] = 5.0
    seq = _seq([0], (0, 3, 4, 5), SamplingParams(max_tokens=10, temperature=0.0))
    assert prediction.verify(seq, logits, [3, 4, 5]) == (2, 1)  # the model says 1, not 5
    assert prediction.verify(seq, logits, [3, 4, 1]) == (3, None)  # all kept


def test_speculative_sampling_leaves_the_distribution_as_it_was() -> None:
    """Over many draws, the first token out (the draft token when accepted, else the
    replacement) follows the processed distribution p, for a likely and an unlikely draft."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.stack([p.log(), p.log()])  # position before the draft, and after it
    params = SamplingParams(max_tokens=10, temperature=1.0)
    for draft in (0, 3):
        seq = _seq([7], (draft,), params, seed=draft)
        counts: collections.Counter[int] = collections.Counter()
        draws = 20000
        for _ in range(draws):
            accepted, replacement = prediction.verify(seq, logits, [draft])
            counts[draft if accepted else replacement] += 1
        for token, want in enumerate(p.tolist()):
            assert abs(counts[token] / draws - want) < 0.015, (draft, token, counts)


def test_top_k_applies_before_acceptance() -> None:
    """A draft token outside top_k has probability 0 and is never kept."""
    p = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.stack([p.log(), p.log()])
    seq = _seq([7], (2,), SamplingParams(max_tokens=10, temperature=1.0, top_k=2), seed=1)
    outs = {prediction.verify(seq, logits, [2])[1] for _ in range(300)}
    assert outs <= {0, 1} and None not in outs
