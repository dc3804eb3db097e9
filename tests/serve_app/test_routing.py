"""Prefix-aware routing across two replicas of one model: requests sharing a long prompt prefix
land on the replica that already holds it (seen as cached prompt tokens); a channel call naming a
replica that is gone ends at once instead of holding one of the router's routing tasks."""

from __future__ import annotations

import asyncio

import pytest
from openai import OpenAI

from replicas.channel import ChannelOpen
from serve_app.app import replica_deployment_name
from serve_app.config import ModelConfig
from tests.conftest import REPLICAS_APP, ROUTED_MODEL, shared_app

MODEL = ROUTED_MODEL
NAME = MODEL["served_model_name"]

pytestmark = pytest.mark.shared_app("replicas")


@pytest.fixture(scope="module")
def client() -> OpenAI:
    url = shared_app(REPLICAS_APP)
    return OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)


def test_shared_prefixes_stick_to_their_replica(client: OpenAI) -> None:
    hits = 0
    for k in range(6):
        system = f"Conversation {k}. " + " ".join(f"fact-{k}-{i}" for i in range(60))
        for question in ("first question", "second question"):
            r = client.chat.completions.create(
                model=NAME, max_tokens=2,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": question}])
            if question == "second question":
                cached = r.usage.prompt_tokens_details.cached_tokens
                hits += cached > 0
    # with random routing each second request would miss with probability 1/2
    assert hits == 6


def test_a_channel_to_a_replica_that_is_gone_ends_and_frees_the_router(client: OpenAI) -> None:
    """Serve retries a call its router cannot place for as long as the call lives, cancelled or
    not, and runs at most two routing tasks a replica: once two channels named replaced replicas
    (a chaos run: the engine core killed until Serve replaced its replica twice), no request
    was routed again. Now such a channel goes to a live replica, which ends it at once."""
    from ray import serve

    handle = serve.get_deployment_handle(
        replica_deployment_name(ModelConfig.model_validate(MODEL)), "shardserve")
    channels = handle.options(stream=True)

    async def open_and_read(k: int) -> bytes | None:
        return await anext(channels.channel.remote(ChannelOpen(f"gone-{k}", "test-ingress")),
                           None)

    async def run() -> tuple[list[bytes | None], dict]:
        # twice the router's routing tasks (2 a replica): before, these alone wedged it
        opened = await asyncio.wait_for(asyncio.gather(*(open_and_read(k) for k in range(8))), 30)
        return opened, await asyncio.wait_for(handle.stats.remote(), 30)

    opened, stats = asyncio.run(run())
    assert opened == [None] * 8
    assert "num_running" in stats
    r = client.chat.completions.create(model=NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "still served?"}])
    assert r.choices[0].finish_reason == "length"
