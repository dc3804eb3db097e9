"""A simulated multi-node cluster: the replica's shard actors land on the node its placement group
puts them on (the one advertising the resource the shard bundles ask for)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import SMALL_MODEL, free_port


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app.app import deploy
    from serve_app.config import AppConfig

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
    assert len(shards) == 2
    assert set(ray.get([s.node_id.remote() for s in shards])) == {gpu_node_id}
