"""The app's config (pydantic, the HTTP boundary's twin for operators): the CLI's flags and the
YAML's fields reach the replica's frozen config, and values out of range are refused."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from serve_app import cli
from serve_app.config import ModelConfig


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_the_kv_cache_flags_reach_the_replica() -> None:
    replica = cli.config_from_args(_serve_args("--gpu-memory-utilization", "0.6")
                                   ).models[0].replica_config()
    assert (replica.gpu_memory_utilization, replica.kv_cache_gib) == (0.6, None)
    sized = cli.config_from_args(_serve_args("--kv-cache-gib", "2")).models[0].replica_config()
    assert sized.kv_cache_gib == 2.0
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="gpu_memory_utilization"):
            ModelConfig(gpu_memory_utilization=bad)


def test_the_core_s_niceness_is_a_model_setting() -> None:
    assert ModelConfig().replica_config().core_niceness == 5
    assert ModelConfig(core_niceness=10).replica_config().core_niceness == 10
    assert ModelConfig(core_niceness=None).replica_config().core_niceness is None
    with pytest.raises(ValidationError, match="core_niceness"):
        ModelConfig(core_niceness=20)


def test_async_scheduling_is_a_flag_and_a_yaml_field() -> None:
    """Off unless asked for (served, it measured slower on CPUs and on an H200); either flag
    wins."""
    def replica(*argv: str):
        return cli.config_from_args(_serve_args(*argv)).models[0].replica_config()
    assert replica().async_scheduling is False
    assert replica("--async-scheduling").async_scheduling is True
    assert replica("--no-async-scheduling").async_scheduling is False
    assert ModelConfig(async_scheduling=True).replica_config().async_scheduling is True
