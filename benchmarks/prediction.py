"""`bench prediction`: what Predicted Outputs (`prediction`) save when the prediction is mostly
right, the way an editor uses it: the model rewrites a text it is given with a small change.

Against a live server: one greedy chat makes the reference output; the prediction is that output
with every `--edit-every`-th word replaced (what the client expects back, nearly). Then rounds
alternate the same request streamed without and with the prediction; each figure is the median
over rounds. Greedy output must be the same text both ways (the benchmark fails otherwise); the
ratio is TPOT with the prediction over TPOT without, and accepted / rejected are the server's
`usage.completion_tokens_details`."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.caps import stream_chat
from benchmarks.client import first_model


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens (ignore_eos)")
    p.add_argument("--edit-every", type=int, default=20,
                   help="replace every Nth word of the reference output in the prediction")
    p.add_argument("--rounds", type=int, default=3, help="without/with pairs")
    p.add_argument("--prompt", default="Rewrite this paragraph about the sea in plain words.")


def edited(text: str, every: int) -> str:
    """`text` with every `every`-th word replaced by another."""
    words = text.split(" ")
    return " ".join("edit" if (i + 1) % every == 0 else w for i, w in enumerate(words))


@dataclass(frozen=True)
class Result:
    without_s: list[float]
    with_s: list[float]
    accepted: list[int]
    rejected: list[int]
    tokens: int

    @property
    def ratio(self) -> float:
        return statistics.median(self.with_s) / statistics.median(self.without_s)


async def run(args: argparse.Namespace) -> Result:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await first_model(args.base_url, args.api_key)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                            "ignore_eos": True,
                            "messages": [{"role": "user", "content": args.prompt}]}
    async with httpx.AsyncClient(headers=headers, timeout=600, trust_env=False) as http:
        reference = await stream_chat(http, url, body)  # (also the warm-up)
        guess = {"prediction": {"type": "content",
                                "content": edited(reference.text, args.edit_every)}}
        without, with_, accepted, rejected = [], [], [], []
        for _ in range(args.rounds):
            plain = await stream_chat(http, url, body)
            predicted = await stream_chat(http, url, {**body, **guess})
            for got in (plain, predicted):
                if got.text != reference.text or got.tpot_s is None:
                    raise RuntimeError("greedy output changed between runs (or was too short)")
            details = (predicted.usage or {}).get("completion_tokens_details") or {}
            without.append(plain.tpot_s)
            with_.append(predicted.tpot_s)
            accepted.append(int(details.get("accepted_prediction_tokens", 0)))
            rejected.append(int(details.get("rejected_prediction_tokens", 0)))
    return Result(without, with_, accepted, rejected, int(reference.usage["completion_tokens"]))


def report(r: Result, every: int) -> str:
    return (f"{'TPOT without ms':>16}{'TPOT with ms':>14}{'ratio':>8}{'accepted':>10}"
            f"{'rejected':>10}   ({r.tokens} tokens, every {every}th word edited, median of "
            f"{len(r.with_s)} rounds)\n"
            f"{statistics.median(r.without_s) * 1e3:>16.2f}"
            f"{statistics.median(r.with_s) * 1e3:>14.2f}{r.ratio:>8.3f}"
            f"{statistics.median(r.accepted):>10.0f}{statistics.median(r.rejected):>10.0f}")


def run_cli(args: argparse.Namespace) -> int:
    print(report(asyncio.run(run(args)), args.edit_every))
    return 0
