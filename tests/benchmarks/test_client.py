"""The streaming client against the fake SSE server: parsing, timing and failure capture."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks.client import ClientConfig, StreamingClient, build_payload, first_model, infer_api, split_gaps
from benchmarks.datasets import BenchRequest
from benchmarks.records import RequestOutcome


def send(base_url: str, request: BenchRequest, **config: Any) -> RequestOutcome:
    async def go() -> RequestOutcome:
        async with StreamingClient(ClientConfig(base_url=base_url, model="m", **config)) as client:
            return await client.send(request)

    return asyncio.run(go())


def req(output_len: int = 5, prompt: str = "one two three", **extra: Any) -> BenchRequest:
    return BenchRequest(prompt, 3, output_len, extra_body=extra, kind="random")


def test_chat_stream_timing_and_usage(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(5, fake_delay_s=0.02), ignore_eos=True)
    assert out.success, out.error
    assert out.output_tokens == 5 and out.usage_reported
    assert out.prompt_len == 3
    assert out.generated_text == "t0 t1 t2 t3 t4 "
    assert len(out.itl) == 4
    # The role-only first chunk is not the first token: TTFT includes one token delay.
    assert out.ttft >= 0.015
    assert all(gap > 0 for gap in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)
    assert out.tpot == pytest.approx(sum(out.itl) / 4)
    assert out.event_gaps == pytest.approx(out.itl)  # a token a chunk: the two agree
    body = fake_server.payloads[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["messages"] == [{"role": "user", "content": "one two three"}]


def test_completions_endpoint(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(3), endpoint="/v1/completions")
    assert out.success and out.output_tokens == 3 and len(out.itl) == 2
    body = fake_server.payloads[-1]
    assert body["prompt"] == "one two three" and "messages" not in body and "ignore_eos" not in body


def test_multi_token_chunks_are_split_evenly_without_per_chunk_usage(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(7, fake_tokens_per_chunk=3, fake_delay_s=0.02))
    assert out.success and out.output_tokens == 7
    # 3 chunks (3+3+1 tokens), 2 gaps carrying the 6 tokens after the first.
    assert len(out.itl) == 6
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)
    # what a reader waited: the 2 gaps themselves, each the sum of the 3 ITL parts it was split in
    assert len(out.event_gaps) == 2
    assert out.event_gaps == pytest.approx((sum(out.itl[:3]), sum(out.itl[3:])))
    assert out.event_gaps[0] == pytest.approx(3 * out.itl[0])


def test_continuous_usage_gives_exact_per_chunk_counts(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(7, fake_tokens_per_chunk=3, fake_delay_s=0.02), continuous_usage_stats=True)
    assert fake_server.payloads[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert out.success and out.output_tokens == 7
    # First chunk carries 3 tokens at TTFT; then 3 tokens (gap split in 3) and 1 token.
    assert len(out.itl) == 4
    assert out.itl[0] == out.itl[1] == out.itl[2]
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)


def test_missing_usage_falls_back_to_chunk_count(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(4, fake_no_usage=True, fake_tokens_per_chunk=2))
    assert out.success and not out.usage_reported
    assert out.output_tokens == 2 and out.prompt_len == 3  # dataset's estimate stands in


def test_http_error_is_a_failed_outcome(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(4, fake_status=503))
    assert not out.success and out.error.startswith("HTTP 503") and "fake failure" in out.error


def test_midstream_error_is_a_failed_outcome(fake_server: Any) -> None:
    out = send(fake_server.base_url, req(6, fake_error_after=2))
    assert not out.success and "boom midstream" in out.error
    assert out.generated_text == "t0 t1 "


def test_connection_refused_is_a_failed_outcome(free_port_url: str) -> None:
    out = send(free_port_url, req(2))
    assert not out.success and "Connect" in out.error


def test_first_model(fake_server: Any) -> None:
    assert asyncio.run(first_model(fake_server.base_url)) == "fake-model"


def test_payload_precedence_and_constrained_requests() -> None:
    config = ClientConfig("http://x", "m", ignore_eos=True, extra_body={"temperature": 0.5, "max_tokens": 9})
    constrained = BenchRequest(
        "p", 1, 50, extra_body={"structured_outputs": {"choice": ["a"]}, "temperature": 0.1}, fixed_output=False
    )
    body = build_payload(config, constrained)
    assert "ignore_eos" not in body  # must be free to stop when the grammar completes
    assert body["structured_outputs"] == {"choice": ["a"]}
    assert body["temperature"] == 0.5 and body["max_tokens"] == 9  # user's --extra-body wins
    assert infer_api("/v1/chat/completions") == "chat" and infer_api("/v1/completions") == "completions"
    assert config.url == "http://x/v1/chat/completions"


def test_split_gaps() -> None:
    times = [1.0, 1.3, 1.4]
    assert split_gaps([1.0], None, 5) == ()
    assert split_gaps(times, None, 3) == pytest.approx((0.3, 0.1))
    # 5 tokens after the first over 2 gaps: 2 + 3 parts, sums preserved.
    itl = split_gaps(times, None, 6)
    assert len(itl) == 5 and sum(itl) == pytest.approx(0.4)
    # Per-chunk counts: a 0-token chunk folds its gap into the next.
    itl = split_gaps([0.0, 0.2, 0.5, 0.6], [2, 0, 3, 1], 6)
    assert itl == pytest.approx((0.5 / 3,) * 3 + (0.1,))
