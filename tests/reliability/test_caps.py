"""Issue 17: one request at every list cap at once (bad_words, logit_bias, allowed_token_ids,
stop, stop_token_ids) barely slows the streams beside it, and one over a cap is a 400 naming the
field, over HTTP against a real app.

The streams' TPOT is measured alone, beside one plain request, and beside the capped request, in
alternating rounds on the same app (median over rounds of the 8 streams' median TPOT). On the
embedded model a step takes a few ms, so one more stream of any kind costs the others ~10% in
this app (measured 1.09-1.17x); the caps' own cost is the capped request against the plain one
(measured 0.93-1.02x). Before the lists were made tensors once per sequence, this request cost
each step ~25 ms (a 262,144-id allowlist rebuilt as a tensor, 256 bad-word spellings walked in
Python): several times the whole step."""

from __future__ import annotations

import asyncio
import statistics

import httpx
import pytest

from benchmarks import caps
from serve_app import protocol as p
from tests.conftest import PLAIN_APP, shared_app

pytestmark = [pytest.mark.slow, pytest.mark.shared_app("plain")]

MODEL = "shardserve/tiny-llama"
STREAMS = 8
# each round spans over a hundred steps: robust to a noisy 2-core VM. ~2 s a round at this box's
# TPOT, within these bounds (512 tokens took 10 s a round on an AVX2-only Zen 3 box, ~2 s on Zen 5;
# the request beside the streams, twice as long and 32 tokens more, fits the app's 1,024)
MIN_TOKENS, MAX_TOKENS = 128, 448
ROUND_S = 2.0
# a clean-clone suite on Zen 4 once measured capped/plain 1.28 over 5 rounds, where its
# streams beside a plain request ran faster than alone (7.37 against 7.81 ms): noisy rounds, the
# same test alone 0.96 and 1.10; the median of 7 rounds' ratios leans less on any two
ROUNDS = 7


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(PLAIN_APP)


def _post(base_url: str, **fields: object) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize(("field", "value"), [
    ("stop", ["x"] * (p.MAX_STOP + 1)),
    ("logit_bias", {str(i): 1 for i in range(p.MAX_LOGIT_BIAS + 1)}),
    ("messages", [{"role": "user", "content": "hi"}] * (p.MAX_MESSAGES + 1)),
])
def test_over_a_cap_is_a_400_naming_the_field(base_url: str, field: str, value: object) -> None:
    r = _post(base_url, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == 400
    assert f"got {len(value)}" in error["message"]  # type: ignore[arg-type]


async def _rounds(base_url: str, capped: dict) -> dict[str, list[float]]:
    root = base_url.removesuffix("/v1")
    out: dict[str, list[float]] = {"alone": [], "plain": [], "capped": []}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as http:
        # warm-up (prefix cache, first allocations), and the TPOT that sizes the rounds
        tpot = await caps.measure_round(http, root, MODEL, STREAMS, 128, None)
        tokens = max(MIN_TOKENS, min(MAX_TOKENS, round(ROUND_S / tpot)))

        async def measure(beside: dict | None) -> float:
            return await caps.measure_round(http, root, MODEL, STREAMS, tokens, beside)

        await measure(capped)
        kinds: list[tuple[str, dict | None]] = [("alone", None), ("plain", {}),
                                                  ("capped", capped)]
        for i in range(ROUNDS):
            # each kind in each place of the round in turn: a drift within rounds favours none
            for kind, beside in kinds[i % 3:] + kinds[:i % 3]:
                out[kind].append(await measure(beside))
    return out


def test_a_request_at_every_cap_barely_slows_the_streams_beside_it(base_url: str) -> None:
    root = base_url.removesuffix("/v1")

    async def vocab() -> int:
        async with httpx.AsyncClient(timeout=30) as http:
            return await caps.vocab_size_of(http, root, MODEL)

    capped = caps.capped_fields("all", asyncio.run(vocab()))
    assert len(capped["allowed_token_ids"]) == p.MAX_ALLOWED_TOKEN_IDS
    r = _post(base_url, **capped, max_tokens=8, ignore_eos=True, min_tokens=8)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text

    rounds = asyncio.run(_rounds(base_url, capped))
    tpot = {k: statistics.median(v) for k, v in rounds.items()}
    # ratios within a round, then their median: this VM's speed drifts between rounds
    vs_plain = statistics.median(c / p for c, p in zip(rounds["capped"], rounds["plain"]))
    vs_alone = statistics.median(c / a for c, a in zip(rounds["capped"], rounds["alone"]))
    print({k: f"{v * 1e3:.2f} ms" for k, v in tpot.items()},
          f"capped/plain {vs_plain:.3f}", f"capped/alone {vs_alone:.3f}")
    # the lists' own cost: beside the capped request vs beside the same request without lists
    # (the lists used to make the streams several times slower; this VM's same load moves by up
    # to ~15% between rounds: a clean-clone suite once measured 1.15 and 1.31 for these two,
    # the same code alone 0.98-1.04 and 1.08)
    assert vs_plain < 1.20, (tpot, vs_plain)
    # and all told, one more stream included
    assert vs_alone < 1.40, (tpot, vs_alone)
