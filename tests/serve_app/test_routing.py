"""Prefix-aware routing across two replicas of one model: requests sharing a long prompt prefix
land on the replica that already holds it (seen as cached prompt tokens)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import SMALL_MODEL, running_app


@pytest.fixture(scope="module")
def client() -> OpenAI:
    model = {**SMALL_MODEL, "num_replicas": 2, "num_threads": 1, "replica_num_cpus": 0.5}
    with running_app({"models": [model]}) as url:
        yield OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)


def test_shared_prefixes_stick_to_their_replica(client: OpenAI) -> None:
    hits = 0
    for k in range(6):
        system = f"Conversation {k}. " + " ".join(f"fact-{k}-{i}" for i in range(60))
        for question in ("first question", "second question"):
            r = client.chat.completions.create(
                model="shardserve/tiny-llama", max_tokens=2,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": question}])
            if question == "second question":
                cached = r.usage.prompt_tokens_details.cached_tokens
                hits += cached > 0
    # with random routing each second request would miss with probability 1/2
    assert hits == 6
