"""Several models in one app, one of them tensor-parallel on CPUs (gloo): rank 0 in its replica's
engine core, rank 1 on a shard actor."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import SMALL_MODEL, shared_app

TP1, TP2 = "tiny", "tiny-tp2"

pytestmark = pytest.mark.shared_app("distributed")


@pytest.fixture(scope="module")
def base_url() -> str:
    models = [{**SMALL_MODEL, "served_model_name": TP1, "num_threads": 1},
              {**SMALL_MODEL, "served_model_name": TP2, "tensor_parallel_size": 2,
               "health_check_period_s": 2,
               "num_threads": 1, "replica_num_cpus": 0.5, "shard_num_cpus": 0.5}]
    return shared_app({"models": models})


def test_models_lists_both(base_url: str) -> None:
    ids = [m.id for m in OpenAI(base_url=base_url, api_key="x").models.list().data]
    assert ids == [TP1, TP2]


def test_tp2_gives_the_same_greedy_tokens_as_tp1(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    for prompt in ("The capital of France", "def fibonacci(n):", "日本語のテキスト"):
        outs = []
        for model in (TP1, TP2):
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
            outs.append(r.choices[0].model_extra["token_ids"])
        assert outs[0] == outs[1], prompt


def test_each_rank_holds_half_the_sharded_weights(base_url: str) -> None:
    import ray
    from ray import serve

    del ray  # the test process is the Ray driver already
    handle = serve.get_deployment_handle("LLMReplica-tiny-tp2", app_name="shardserve")
    info = handle.info.remote().result()
    one = serve.get_deployment_handle("LLMReplica-tiny", app_name="shardserve").info.remote(
    ).result()
    full = one["shard_num_parameters"][0]
    ranks = info["shard_num_parameters"]
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    # everything but the norms (replicated, tiny) is split in two
    assert 0.5 * full < ranks[0] < 0.52 * full


def test_model_field_routes(base_url: str) -> None:
    r = httpx.post(f"{base_url}/chat/completions", json={
        "model": f"acme/{TP2}", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == TP2


def test_killed_shard_actor_gets_new_shards(base_url: str) -> None:
    """A dead rank fails the engine core; the replica starts a new core with new shards."""
    import ray

    client = OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=90)
    actors = sorted((a["name"], a["namespace"])
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("shard-"))
    assert len(actors) == 1  # rank 1; rank 0 runs in the engine core
    ids = {ray.get_actor(*a)._actor_id.hex() for a in actors}
    ray.kill(ray.get_actor(*actors[0]))
    # the next requests fail fast (or succeed on a replacement), never hang
    deadline = time.monotonic() + 120
    ok = False
    while time.monotonic() < deadline and not ok:
        try:
            r = client.chat.completions.create(
                model=TP2, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
            ok = r.choices[0].finish_reason is not None
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            assert getattr(exc, "status_code", 503) in (500, 502, 503)
            time.sleep(1)
    assert ok
    new = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
           if a["name"].startswith("shard-")]
    assert len(new) == 1
    assert ids.isdisjoint(ray.get_actor(*a)._actor_id.hex() for a in new)
