"""`bench caps`: the capped request it sends, its cases, its measurement rounds and its report."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from benchmarks import caps
from serve_app import protocol as p


def test_the_all_case_sends_every_list_at_its_cap_within_the_vocabulary() -> None:
    fields = caps.capped_fields("all", vocab_size=4000)
    assert set(fields) == set(caps.LISTS)
    assert len(fields["bad_words"]) == p.MAX_BAD_WORDS
    assert len(fields["logit_bias"]) == p.MAX_LOGIT_BIAS
    assert len(fields["allowed_token_ids"]) == p.MAX_ALLOWED_TOKEN_IDS
    assert set(fields["allowed_token_ids"]) == set(range(4000))  # nothing is left out
    assert len(fields["stop"]) == p.MAX_STOP
    assert {len(s) for s in fields["stop"]} == {p.MAX_STOP_CHARS}
    assert len(fields["stop_token_ids"]) == p.MAX_STOP_TOKEN_IDS
    assert max(int(t) for t in fields["logit_bias"]) < 4000
    # the server accepts it: it passes the request model's caps
    p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                            **fields})
    assert len(json.dumps(fields)) < 4 * 2**20  # under the server's body limit
    assert caps.capped_fields("plain", 4000) == {}
    assert set(caps.capped_fields("stop", 4000)) == {"stop"}


def test_cases_parse_and_unknown_ones_are_refused() -> None:
    assert caps.parse_cases("all, stop") == ("all", "stop")
    with pytest.raises(ValueError, match="bogus"):
        caps.parse_cases("all,bogus")
    parser = argparse.ArgumentParser()
    caps.add_cli_args(parser)
    args = parser.parse_args(["--cases", "bogus"])
    assert caps.run_cli(args) == 2


def test_rounds_alternate_against_a_server_and_the_report_has_each_ratio(fake_server) -> None:
    parser = argparse.ArgumentParser()
    caps.add_cli_args(parser)
    args = parser.parse_args(["--base-url", fake_server.base_url, "--model", "fake-model",
                              "--streams", "3", "--max-tokens", "4", "--rounds", "2",
                              "--cases", "plain,all", "--vocab-size", "100"])
    before = len(fake_server.payloads)
    results = asyncio.run(caps.run(args))
    sent = fake_server.payloads[before:]
    # a warm-up round, then per case and round: 3 streams alone, the capped request + 3 streams
    assert len(sent) == 3 + 2 * 2 * (3 + 3 + 1)
    capped = [b for b in sent if "allowed_token_ids" in b]
    assert len(capped) == 2 and all(b["max_tokens"] == 2 * 4 + 32 for b in capped)
    assert all(b["min_tokens"] == b["max_tokens"] for b in capped)  # stop ids held off
    assert [r.case for r in results] == ["plain", "all"]
    for r in results:
        assert len(r.alone_s) == len(r.beside_s) == 2
        assert all(0.005 < t < 0.1 for t in r.alone_s + r.beside_s)  # the fake's 10 ms
    text = caps.report(results, 3)
    assert "plain" in text and "all" in text and f"{results[1].ratio:.3f}" in text
    assert f"{results[1].ratio / results[0].ratio:.3f}" in text.splitlines()[2]
