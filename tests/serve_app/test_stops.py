"""Issue 18: every reported token is one the client got. Under a load of 32 background streams
(so the replica groups each request's tokens into a few messages, and a stop string lands
mid-group), stop strings spanning 1, 2 and 3 tokens at n = 1 and n = 2, streamed and not:
usage == len(token_ids) == len(logprobs.content) == the tokens up to the one that completed the
stop string, and `/metrics`' generation tokens grow by exactly what every client got.

The expected cut comes from a reference run of the same seeded request without the stop string
(seeded rows draw from their own generator, so a choice's tokens do not depend on the batch)."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from replicas.embedded import EMBEDDED_MODEL_ID
from replicas.model_files import resolve_model_path
from tests.conftest import PLAIN_APP, shared_app

pytestmark = [pytest.mark.slow, pytest.mark.shared_app("plain")]

MODEL = "shardserve/tiny-llama"
BACKGROUND = 32
MAX_TOKENS = 48
SEED = 1234


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(PLAIN_APP)  # 48 sequences at once


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_MODEL_ID))


def _body(n: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {n}."}],
            "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": SEED + n, "n": n,
            "logprobs": True,
            "extra_body": {"return_token_ids": True, "ignore_eos": True, **extra}}


def _stop_spanning(tokenizer: Any, ids: list[int], span: int) -> str:
    """A stop string made of `span` tokens of the output that first appears where they end."""
    for start in range(2, len(ids) - span):
        stop = tokenizer.decode(ids[start:start + span], skip_special_tokens=True)
        before = tokenizer.decode(ids[:start + span - 1], skip_special_tokens=True)
        pieces = [tokenizer.decode([t]) for t in ids[start:start + span]]
        if (stop.strip() and "\ufffd" not in stop and stop not in before
                and all(p.strip() and p in stop for p in pieces)):
            return stop
    raise AssertionError(f"no stop string of {span} tokens in {ids}")


def _expected_cut(tokenizer: Any, ids: list[int], stop: str) -> int:
    """The tokens a client gets: up to the first whose text completes the stop string."""
    return next((k for k in range(1, len(ids) + 1)
                 if stop in tokenizer.decode(ids[:k], skip_special_tokens=True)), len(ids))


async def _whole(client: AsyncOpenAI, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.chat.completions.create(**body)
    return {"usage": r.usage.completion_tokens,
            "choices": {c.index: {"ids": list(c.token_ids), "logprobs": len(c.logprobs.content),
                                  "finish": c.finish_reason} for c in r.choices}}


async def _streamed(client: AsyncOpenAI, body: dict[str, Any]) -> dict[str, Any]:
    stream = await client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True})
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            st = choices.setdefault(c.index, {"ids": [], "logprobs": 0, "finish": None})
            st["ids"] += list(getattr(c, "token_ids", None) or [])
            st["logprobs"] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            st["finish"] = c.finish_reason or st["finish"]
    return {"usage": usage, "choices": choices}


async def _background(client: AsyncOpenAI, i: int) -> int:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"background {i}"}], max_tokens=160,
        extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True})
    used = 0
    async for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return used


def _generation_tokens(root: str) -> float:
    text = httpx.get(f"{root}/metrics", timeout=30).text
    m = re.search(r'^vllm:generation_tokens_total\{model_name="shardserve/tiny-llama"\} (\S+)$',
                  text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def _settled_generation_tokens(root: str) -> float:
    """Once the replicas' reports (every 0.5 s) have caught up: two reads 1.5 s apart agree."""
    last = _generation_tokens(root)
    for _ in range(20):
        time.sleep(1.5)
        now = _generation_tokens(root)
        if now == last:
            return now
        last = now
    return last


def test_stops_are_exact_under_load(base_url: str, tokenizer: Any) -> None:
    root = base_url.removesuffix("/v1")
    before = _settled_generation_tokens(root)

    async def scenario() -> tuple[list[tuple[str, dict, dict]], int]:
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
        background = [asyncio.ensure_future(_background(client, i)) for i in range(BACKGROUND)]
        await asyncio.sleep(1.0)  # the background is decoding: messages are grouped
        refs = {n: await _whole(client, _body(n)) for n in (1, 2)}
        cases = []
        for n in (1, 2):
            for span in (1, 2, 3):
                stop = _stop_spanning(tokenizer, refs[n]["choices"][0]["ids"], span)
                for fn in (_whole, _streamed):
                    cases.append((f"n={n} span={span} {fn.__name__}", n, stop, fn))
        results = await asyncio.gather(*(fn(client, {**_body(n), "stop": [stop]})
                                         for _, n, stop, fn in cases))
        spent = sum(await asyncio.gather(*background))
        spent += sum(r["usage"] for r in refs.values()) + sum(r["usage"] for r in results)
        assert all(not b.done() or b.result() == 160 for b in background)
        return [(name, refs[n], {**res, "stop": stop})
                for (name, n, stop, _), res in zip(cases, results)], spent

    outcomes, spent = asyncio.run(scenario())
    for name, ref, got in outcomes:
        total = 0
        for index, choice in got["choices"].items():
            full = ref["choices"][index]["ids"]
            cut = _expected_cut(tokenizer, full, got["stop"])
            assert choice["ids"] == full[:cut], (name, index, got["stop"])
            assert choice["logprobs"] == cut, (name, index)
            assert choice["finish"] == ("stop" if cut < len(full) else "length"), (name, index)
            total += cut
        assert got["usage"] == total, name
    assert _settled_generation_tokens(root) - before == spent
