"""The sampler's draws: right frequencies at a temperature, never a masked token, seeded rows
independent of their batch; each request list masks what it names, and a step costs no more for
long lists."""

from __future__ import annotations

import time

import pytest
import torch

from replicas import kernels, sampler
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


@pytest.fixture(params=["native", "torch"])
def draw_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The draw as CPUs with the native kernels take it (kernels.draw) and as torch does (GPUs,
    or a machine without a compiler)."""
    if request.param == "native" and not kernels.supports_draw(torch.zeros(1, 4)):
        pytest.skip("no native kernels on this machine")
    if request.param == "torch":
        monkeypatch.setattr(kernels, "supports_draw", lambda x: False)
    return request.param


def _logits(rows: int, probs: dict[int, float], vocab: int = 300) -> torch.Tensor:
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, list(probs)] = torch.tensor(list(probs.values())).log()
    return logits


def test_frequencies_follow_the_tempered_probabilities(draw_path: str) -> None:
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


def test_a_seed_draws_the_same_token_whatever_shares_the_batch(draw_path: str) -> None:
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1))
    alone = [sample(logits.clone(), _seqs(1, seeds=[s]), frozenset()).token_ids[0]
             for s in range(20)]
    seeds = [None, *range(20), *[None] * 19]
    batch = sample(logits.expand(40, -1).clone(), _seqs(40, seeds=seeds), frozenset()).token_ids
    assert batch[1:21] == alone
    assert len(set(alone)) > 5  # and the seeds do differ


def _row(params: SamplingParams, output: list[int] = ()) -> Sequence:
    return Sequence(0, "r", 0, [1, *output], 1, params)


def _greedy(seq: Sequence, order: list[int], eos: frozenset[int] = frozenset(),
            vocab: int = 50) -> int:
    """The token greedy sampling picks when `order` ranks the vocabulary best first."""
    logits = torch.zeros(1, vocab)
    logits[0, order] = torch.arange(len(order), 0, -1, dtype=torch.float32) * 10
    return sample(logits, [seq], eos).token_ids[0]


def test_allowed_token_ids_leave_only_their_tokens() -> None:
    seq = _row(SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=(30, 31)))
    assert _greedy(seq, [1, 2, 31, 30]) == 31


def test_bad_words_ban_single_tokens_and_the_completion_of_a_prefix() -> None:
    words = ((7,), (3, 4), (5, 3, 9))
    params = SamplingParams(max_tokens=8, temperature=0.0, bad_words_token_ids=words)
    assert _greedy(_row(params, [6]), [7, 4, 9, 10]) == 4  # no prefix in the output: 4 is free
    assert _greedy(_row(params, [6, 3]), [7, 4, 9, 10]) == 9  # after 3, 4 would complete (3, 4)
    assert _greedy(_row(params, [5, 3]), [7, 4, 9, 10]) == 10  # and after 5 3, 9 is banned too
    # a prefix counts only inside the output, as in vLLM: the prompt ends with 1 here
    assert _greedy(_row(SamplingParams(max_tokens=8, temperature=0.0,
                                       bad_words_token_ids=((1, 4),))), [4, 10]) == 4


def test_min_tokens_holds_off_eos_and_stop_token_ids_then_lets_them_come() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2, stop_token_ids=(8,))
    seq = _row(params, [6])
    assert _greedy(seq, [2, 8, 11], eos=frozenset({2})) == 11
    seq.token_ids.append(11)
    assert _greedy(seq, [2, 8, 11], eos=frozenset({2})) == 2


def test_logit_bias_adds_to_the_logits_and_repeats_accumulate() -> None:
    seq = _row(SamplingParams(max_tokens=4, temperature=0.0,
                              logit_bias=((12, 15.0), (13, 8.0), (13, 8.0))))
    assert _greedy(seq, [1]) == 13  # 1 scores 10, 12 scores 15, 13 scores 16


def test_a_rows_lists_become_tensors_once_and_cost_no_more_with_their_length() -> None:
    vocab = 4096
    small = SamplingParams(max_tokens=64, temperature=0.0, allowed_token_ids=(5,),
                           logit_bias=((5, 1.0),), bad_words_token_ids=((7,), (8, 9)),
                           stop_token_ids=(10,), min_tokens=64)
    big = SamplingParams(
        max_tokens=64, temperature=0.0, allowed_token_ids=tuple(range(vocab)) * 64,
        logit_bias=tuple((t, 0.5) for t in range(1024)),
        bad_words_token_ids=tuple((t, t + 1, t + 2) for t in range(1000, 1256)),
        stop_token_ids=tuple(range(2000, 3024)), min_tokens=64)

    def per_step(params: SamplingParams) -> float:
        seqs = [_row(params, [6]) for _ in range(4)]
        logits = torch.randn(4, vocab)
        sample(logits.clone(), seqs, frozenset({2}))  # the first step builds the tables
        tables = [s.sampling_tables for s in seqs]
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(20):
                sample(logits.clone(), seqs, frozenset({2}))
            best = min(best, time.perf_counter() - started)
        assert [s.sampling_tables for s in seqs] == tables  # built once, reused
        return best

    # the lists above are 64x-1000x longer; a step walking them would be tens of times slower
    assert per_step(big) < 3 * per_step(small)


def _sorted_truncation(logits: torch.Tensor, k: list[int], p: list[float]) -> torch.Tensor:
    """top_k / top_p by a full descending sort: the definition `_truncate` must equal."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    cut = ranks >= torch.tensor(k).clamp(min=1).unsqueeze(1)
    probs = sorted_logits.softmax(-1)
    cut |= (probs.cumsum(-1) - probs) >= torch.tensor(p).unsqueeze(1)
    return torch.empty_like(logits).scatter_(1, order,
                                             sorted_logits.masked_fill(cut, float("-inf")))


def test_top_k_top_p_over_a_window_equals_the_full_sort() -> None:
    from replicas.sampler import _truncate
    g = torch.Generator().manual_seed(5)
    vocab = 5000
    # peaked rows (low temperature: the mass in a few tokens), flat rows (the window must
    # widen to the whole row), top_k only, both, and a row with banned tokens
    logits = torch.cat([torch.randn(3, vocab, generator=g) * 8, torch.randn(3, vocab, generator=g)
                        * 0.01, torch.randn(2, vocab, generator=g)])
    logits[7, :4000] = float("-inf")
    k = [vocab, 5, vocab, 300, vocab, 1, 70, vocab]
    p = [0.9, 1.0, 0.5, 0.95, 0.999, 0.9, 1.0, 0.99]
    got, _ = _truncate(logits.clone(), k, p)
    want = _sorted_truncation(logits, k, p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    assert (~torch.isinf(got[1])).sum() == 5 and (~torch.isinf(got[5])).sum() == 1
    assert (~torch.isinf(got[4])).sum() > 4000  # the flat row's window widened to the row


def test_penalties_change_only_the_seen_tokens_as_defined(draw_path: str) -> None:
    from replicas.sampler import apply_penalties
    g = torch.Generator().manual_seed(6)
    vocab = 400
    seqs = _seqs(3)
    prompts = [[5, 9, 9, 300], [7], [1, 2, 3]]
    outputs = [[9, 11, 11], [], [3]]
    params = [dict(repetition_penalty=1.3), dict(repetition_penalty=1.0, presence_penalty=0.5),
              dict(repetition_penalty=0.8, frequency_penalty=0.25)]
    for s, prompt, out, kw in zip(seqs, prompts, outputs, params):
        s.params = SamplingParams(max_tokens=4, **kw)
        s.token_ids = prompt + out
        s.num_prompt_tokens = len(prompt)
    logits = torch.randn(3, vocab, generator=g) * 3
    want = logits.clone()
    for i, s in enumerate(seqs):  # the definitions, token by token
        r = s.params.repetition_penalty
        for t in set(s.token_ids):
            want[i, t] = want[i, t] / r if want[i, t] > 0 else want[i, t] * r
        for t in set(s.output_token_ids):
            n = list(s.output_token_ids).count(t)
            want[i, t] -= s.params.frequency_penalty * n + s.params.presence_penalty
    apply_penalties(logits, seqs)
    assert torch.equal(logits, want)  # the same float operations: the same bits


def test_native_penalties_give_torchs_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels.supports_draw(torch.zeros(1, 4)):
        pytest.skip("no native kernels on this machine")
    from replicas.sampler import apply_penalties
    g = torch.Generator().manual_seed(8)
    vocab, rows = 1000, 16
    seqs = _seqs(rows)
    for i, s in enumerate(seqs):
        prompt = torch.randint(0, 50, (int(torch.randint(1, 300, (1,), generator=g)),),
                               generator=g).tolist()  # repeats within and across prompt/output
        out = torch.randint(0, 60, (i * 7,), generator=g).tolist()
        s.params = SamplingParams(max_tokens=4, repetition_penalty=[1.0, 1.2, 0.9][i % 3],
                                  frequency_penalty=[0.0, 0.4, -0.3, 1.5][i % 4],
                                  presence_penalty=[0.0, 0.7, -1.1][i % 3])
        s.token_ids, s.num_prompt_tokens = prompt + out, len(prompt)
    logits = torch.randn(rows, vocab, generator=g) * 5
    native = logits.clone()
    apply_penalties(native, seqs)
    monkeypatch.setattr(kernels, "supports_draw", lambda x: False)
    apply_penalties(logits, seqs)
    assert torch.equal(native, logits)


def test_logprobs_native_and_torch_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """compute_logprobs on CPUs (native passes) and as GPUs take it (log_softmax, topk): the
    same tokens, ranks and alternatives, values within float32 rounding."""
    from replicas.sampler import compute_logprobs
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 3000, generator=g) * 4
    tokens = torch.randint(0, 3000, (6,), generator=g)
    top_n = [0, 1, 5, 20, 3, 20]
    native = compute_logprobs(logits, tokens, top_n)
    monkeypatch.setattr(kernels, "supports_logprobs", lambda x, k: False)
    ref = compute_logprobs(logits, tokens, top_n)
    for a, b, n in zip(native, ref, top_n):
        assert (a.token_id, a.rank) == (b.token_id, b.rank) and len(a.top) == len(b.top) == n
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=2e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=2e-5)
    best = compute_logprobs(logits[:1], logits[:1].argmax(-1), [3])[0]  # (torch's path here)
    monkeypatch.undo()
    mine = compute_logprobs(logits[:1], logits[:1].argmax(-1), [3])[0]
    assert mine.rank == best.rank == 1 and mine.top[0] == (mine.token_id, mine.logprob)


def _wide(rows: int, vocab: int = 300) -> torch.Tensor:
    """Rows whose top_p set reaches far past the sampler's first window of 64 logits."""
    g = torch.Generator().manual_seed(11)
    return (torch.randn(vocab, generator=g) * 0.5).expand(rows, -1).clone()


@pytest.mark.parametrize("rejections", [16, 0])  # 0: every row's set built exactly instead
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (150, 0.95), (250, 1.0)])
def test_wide_top_k_top_p_sets_are_drawn_with_their_renormalised_probabilities(
        monkeypatch: pytest.MonkeyPatch, draw_path: str, rejections: int, top_k: int,
        top_p: float) -> None:
    monkeypatch.setattr(sampler, "MAX_REJECTIONS", rejections)
    torch.manual_seed(3)
    rows, vocab = 20000, 300
    logits = _wide(rows, vocab)
    k = top_k if top_k else vocab
    want = _sorted_truncation(logits[:1], [k], [top_p])[0].softmax(-1)
    assert int((want > 0).sum()) > 64  # past the first window: drawn by rejection
    seqs = [Sequence(i, f"r{i}", 0, [1], 1, SamplingParams(max_tokens=4, top_k=top_k,
                                                           top_p=top_p)) for i in range(rows)]
    tokens = torch.tensor(sample(logits, seqs, frozenset()).token_ids)
    assert bool((want[tokens] > 0).all())  # never a token outside the set
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    torch.testing.assert_close(freq, want, atol=0.006, rtol=0)


def test_a_seed_draws_the_same_token_through_rejections(draw_path: str) -> None:
    logits = _wide(1)
    params = SamplingParams(max_tokens=4, top_p=0.8, seed=1)

    def seqs(seeds: list[int | None]) -> list[Sequence]:
        out = [Sequence(i, f"r{i}", 0, [1], 1, params) for i in range(len(seeds))]
        for s, seed in zip(out, seeds):
            if seed is not None:
                s.generator = torch.Generator().manual_seed(seed)
        return out
    alone = [sample(logits.clone(), seqs([s]), frozenset()).token_ids[0] for s in range(20)]
    batch = sample(logits.expand(41, -1).clone(), seqs([None, *range(20), *[None] * 20]),
                   frozenset()).token_ids
    assert batch[1:21] == alone and len(set(alone)) > 5


@pytest.mark.parametrize("params,want", [
    (dict(top_p=0.8), {7: 0.5 / 0.8, 8: 0.3 / 0.8}),
    (dict(top_k=2), {7: 0.5 / 0.8, 8: 0.3 / 0.8}),
    (dict(top_k=3, top_p=0.96), {7: 0.5 / 0.95, 8: 0.3 / 0.95, 299: 0.15 / 0.95}),
    # min_p keeps the tokens within its share of the largest's probability, before top_p
    (dict(min_p=0.2), {7: 0.5 / 0.95, 8: 0.3 / 0.95, 299: 0.15 / 0.95}),
    (dict(min_p=0.5), {7: 0.5 / 0.8, 8: 0.3 / 0.8}),
    (dict(min_p=0.2, top_p=0.8), {7: 0.5 / 0.8, 8: 0.3 / 0.8})])
def test_a_set_inside_the_window_is_drawn_with_its_renormalised_probabilities(
        draw_path: str, params: dict, want: dict[int, float]) -> None:
    torch.manual_seed(4)
    rows = 20000
    # the rest of the mass spread thin over the other 297 tokens
    logits = _logits(rows, {7: 0.5, 8: 0.3, 299: 0.15, **{t: 0.05 / 297 for t in range(9, 299)},
                            **{t: 0.05 / 297 for t in range(7)}})
    seqs = [Sequence(i, f"r{i}", 0, [1], 1, SamplingParams(max_tokens=4, **params))
            for i in range(rows)]
    tokens = torch.tensor(sample(logits, seqs, frozenset()).token_ids)
    assert set(tokens.unique().tolist()) == set(want)
    freq = torch.bincount(tokens, minlength=300).float() / rows
    torch.testing.assert_close(freq[list(want)], torch.tensor(list(want.values())), atol=0.015,
                               rtol=0)


def test_min_p_holds_through_rejections(monkeypatch: pytest.MonkeyPatch, draw_path: str) -> None:
    """A wide top_p set under min_p: drawn by rejection (and, with no rounds, built exactly)
    from the tokens min_p keeps, with their renormalised probabilities."""
    torch.manual_seed(6)
    rows, vocab = 20000, 300
    logits = _wide(rows, vocab)
    kept = logits[:1].masked_fill(logits[:1].softmax(-1) < 0.2 * logits[:1].softmax(-1).max(),
                                  float("-inf"))
    want = _sorted_truncation(kept, [vocab], [0.9])[0].softmax(-1)
    assert 64 < int((want > 0).sum()) < int((logits[0].softmax(-1) > 0).sum())
    seqs = [Sequence(i, f"r{i}", 0, [1], 1, SamplingParams(max_tokens=4, min_p=0.2, top_p=0.9))
            for i in range(rows)]
    for rejections in (16, 0):
        monkeypatch.setattr(sampler, "MAX_REJECTIONS", rejections)
        tokens = torch.tensor(sample(logits.clone(), seqs, frozenset()).token_ids)
        assert bool((want[tokens] > 0).all())
        freq = torch.bincount(tokens, minlength=vocab).float() / rows
        torch.testing.assert_close(freq, want, atol=0.006, rtol=0)


def test_a_seed_draws_the_same_token_inside_its_window_whatever_shares_the_batch(
        draw_path: str) -> None:
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(2)) * 3
    params = SamplingParams(max_tokens=4, top_p=0.9, temperature=0.7)

    def seqs(seeds: list[int | None], plain: int = 0) -> list[Sequence]:
        out = [Sequence(i, f"r{i}", 0, [1], 1, params) for i in range(len(seeds))]
        out += [Sequence(len(seeds) + i, "p", 0, [1], 1, SamplingParams(max_tokens=4))
                for i in range(plain)]  # rows without a set share the batch
        for s, seed in zip(out, seeds):
            if seed is not None:
                s.generator = torch.Generator().manual_seed(seed)
        return out
    alone = [sample(logits.clone(), seqs([s]), frozenset()).token_ids[0] for s in range(20)]
    batch = sample(logits.expand(45, -1).clone(), seqs([None, *range(20), *[None] * 20], plain=4),
                   frozenset()).token_ids
    assert batch[1:21] == alone and len(set(alone)) > 3
