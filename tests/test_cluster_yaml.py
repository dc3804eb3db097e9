"""cluster.yaml and serve_config.yaml, checked with Ray's own validation (no cloud, no cluster):
the launcher's JSON schema and config preparation, Serve's deploy schema, and the application
builder named by serve_config.yaml's import_path."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return _load("cluster.yaml")


@pytest.fixture(scope="module")
def serve_config() -> dict[str, Any]:
    return _load("serve_config.yaml")


def test_cluster_yaml_passes_the_launchers_schema_as_written(cluster: dict[str, Any]) -> None:
    # the raw file, before defaults are merged in: a misspelt key fails here
    import ray.autoscaler
    schema_path = Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json"
    jsonschema.validate(cluster, json.loads(schema_path.read_text()))


def test_cluster_yaml_prepares_and_validates_like_ray_up(cluster: dict[str, Any]) -> None:
    # what `ray up` does before it reaches the cloud: merge the AWS defaults, then validate
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"] == {**prepared["provider"], "type": "aws", "region": "us-west-2"}
    assert set(prepared["available_node_types"]) == {"head", "gpu-1x", "gpu-8x"}
    # our setup replaces the defaults' (and keeps boto3 on the head, which the autoscaler needs)
    assert prepared["head_setup_commands"][: len(cluster["setup_commands"])] == \
        cluster["setup_commands"]
    assert any("boto3" in c for c in prepared["head_setup_commands"])


def test_worker_types_advertise_gpus_and_the_head_none(cluster: dict[str, Any]) -> None:
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    expected = {"gpu-1x": (1, 8), "gpu-8x": (8, 2)}
    for name, (gpus, max_workers) in expected.items():
        node = types[name]
        assert node["resources"]["GPU"] == gpus
        assert (node["min_workers"], node["max_workers"]) == (0, max_workers)
    assert cluster["max_workers"] >= sum(m for _, m in expected.values())
    assert cluster["idle_timeout_minutes"] > 0


def test_head_starts_ray_then_deploys_serve_config(cluster: dict[str, Any]) -> None:
    cmds = cluster["head_start_ray_commands"]
    start = next(i for i, c in enumerate(cmds) if "ray start --head" in c)
    deploy = next(i for i, c in enumerate(cmds) if "serve deploy" in c)
    assert start < deploy
    assert "~/shardserve/serve_config.yaml" in cmds[deploy]
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c
               for c in cluster["worker_start_ray_commands"])


def test_setup_ships_and_installs_this_tree_with_this_ray(cluster: dict[str, Any]) -> None:
    import ray

    assert cluster["file_mounts"] == {"~/shardserve": "."}
    setup = cluster["setup_commands"]
    assert any("pip install -e ~/shardserve" in c for c in setup)
    assert any(c.startswith("pip install") and "torch" in c for c in setup)
    # a launcher and a cluster on different Ray versions do not work together
    assert any(f"ray[default,serve]=={ray.__version__}" in c for c in setup), \
        "pin the cluster's Ray to the installed version in cluster.yaml"


def test_serve_config_passes_serves_deploy_schema(serve_config: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    assert schema.http_options.host == "0.0.0.0"  # reachable from outside the head node
    assert [(a.import_path, a.route_prefix) for a in schema.applications] == [
        ("serve_app.app:app_builder", "/"), ("serve_app.health:health_builder", "/health")]
    # the health application reads the status board of the application beside it
    assert schema.applications[1].args["app_name"] == schema.applications[0].name


def test_serve_config_import_path_builds_the_app(serve_config: dict[str, Any]) -> None:
    from ray._common.utils import import_attr
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    for app in ServeDeploySchema.model_validate(serve_config).applications:
        # the path `serve run` / `serve deploy` take from import_path and args
        built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path),
                                                             app.args)
        assert isinstance(built, Application)
