"""A simulated multi-node cluster: the replica (whose engine core computes rank 0) and its other
ranks' shard actors land on the node its placement group puts them on (the one advertising the
resource the ranks ask for)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import SMALL_MODEL, free_port, stop_shared_app


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app.app import deploy
    from serve_app.config import AppConfig

    stop_shared_app()  # one Ray instance at a time in this process
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    gpu_node = c.add_node(num_cpus=2, resources={"fake_gpu": 2})
    ray.init(address=c.address, log_to_driver=False)
    port = free_port()
    model = {**SMALL_MODEL, "tensor_parallel_size": 2, "num_threads": 1,
             "replica_num_cpus": 0.5, "shard_num_cpus": 0.5, "shard_resources": {"fake_gpu": 1},
             "placement_group_strategy": "PACK"}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy(AppConfig.model_validate({"port": port, "models": [model]}))
        yield f"http://127.0.0.1:{port}/v1", gpu_node.node_id
    finally:
        ray.shutdown()  # and the cluster with it: no graceful serve.shutdown() needed
        c.shutdown()


def test_shards_land_on_the_node_with_their_resource(cluster) -> None:
    import ray

    url, gpu_node_id = cluster
    r = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120).chat.completions.create(
        model="shardserve/tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].finish_reason is not None
    shards = [ray.get_actor(a["name"], namespace=a["namespace"])
              for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("shard-")]
    assert len(shards) == 1  # rank 1; rank 0 runs in the replica's engine core
    assert set(ray.get([s.node_id.remote() for s in shards])) == {gpu_node_id}
    # the replica's group: bundle 0 (the replica, its core and rank 0) asks for the resource too
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1
    assert set(groups[0]["bundles_to_node_id"].values()) == {gpu_node_id}
    assert groups[0]["bundles"][0].get("fake_gpu") == 1
