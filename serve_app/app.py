"""build_app(config) -> serve.Application: one LLMReplica deployment per model, one ingress;
`deploy` runs it and its /health application (serve_app/health.py) side by side.

`app_builder` is the entry `serve run serve_config.yaml` / `serve deploy` use (the YAML lists the
health application too); the CLI (`shardserve serve`) and the tests deploy with `deploy`."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from replicas.deployment import LLMReplica
from replicas.router import STATS_PERIOD_S
from serve_app.config import AppConfig, ModelConfig
from serve_app.health import HEALTH_ROUTE, build_health_app, health_app_name
from serve_app.ingress import Ingress

INGRESS_MAX_ONGOING = 100_000


def replica_deployment_name(model: ModelConfig) -> str:
    return "LLMReplica-" + re.sub(r"[^A-Za-z0-9_-]", "_", model.name)


def replica_options(model: ModelConfig) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": replica_deployment_name(model),
        # bounded queues: what the engine can hold, and a bounded wait in each caller's router
        # beyond it (BackPressureError there: the ingress answers 503)
        "max_ongoing_requests": model.replica_max_ongoing_requests,
        "max_queued_requests": model.replica_max_queued_requests,
        "health_check_period_s": model.health_check_period_s,
        "request_router_config": RequestRouterConfig(
            request_router_class="replicas.router:PrefixAffinityRouter",
            request_router_kwargs={"imbalance": model.routing_imbalance},
            request_routing_stats_period_s=STATS_PERIOD_S),
    }
    if model.autoscaling_config is not None:
        options["autoscaling_config"] = model.autoscaling_config.model_dump()
    else:
        options["num_replicas"] = model.num_replicas
    # the replica's engine core computes rank 0 in its own process (at tp = 1 the whole model):
    # the replica asks for rank 0's accelerator
    replica: dict = {"num_cpus": model.replica_num_cpus, "num_gpus": model.shard_num_gpus}
    if model.shard_resources:
        replica["resources"] = dict(model.shard_resources)
    options["ray_actor_options"] = replica
    if model.tensor_parallel_size > 1:
        # bundle 0: the replica, its core and rank 0; bundles 1..N-1: ranks 1..N-1's actors
        shard: dict[str, float] = {"CPU": model.shard_num_cpus, **model.shard_resources}
        if model.shard_num_gpus:
            shard["GPU"] = model.shard_num_gpus
        options["placement_group_bundles"] = ([{**shard, "CPU": model.replica_num_cpus}]
                                              + [shard] * (model.tensor_parallel_size - 1))
        options["placement_group_strategy"] = model.placement_group_strategy
    return options


def build_app(config: AppConfig) -> Application:
    # a replica being stopped (scale-down, redeploy, shutdown) finishes its requests for up to
    # shutdown_grace_s, checking every 0.5 s (Serve's default check waits 2 s even when idle)
    grace = {"graceful_shutdown_timeout_s": config.shutdown_grace_s,
             "graceful_shutdown_wait_loop_s": min(0.5, config.shutdown_grace_s)}
    handles = {m.name: LLMReplica.options(**replica_options(m), **grace).bind(
        m.replica_config(config.logits_processors), m.name)
               for m in config.models}
    return Ingress.options(
        num_replicas=config.ingress_num_replicas,
        # Serve's own slot limit would queue /health behind generation work; the ingress admits
        # generation requests itself (serve_app/admission.py), so Serve's bound only guards
        # against a flood of connections
        max_ongoing_requests=INGRESS_MAX_ONGOING, **grace,
        ray_actor_options={"num_cpus": config.ingress_num_cpus}).bind(config, handles)


# Serve's controller reconciles every 0.1 s by default: 3.6% of a core on an idle 2-core VM,
# taken from the engine's threads; 1.6% at 0.5 s. Autoscaling decides over windows of seconds,
# so nothing waits on the faster loop. Replicas run our code and their router on the replica's
# own event loop (two of the knobs of Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED) rather than on
# loops in threads of their own: every SSE event otherwise crossed from the user code's thread
# to the HTTP server's, and every handle call to the router's. An ingress streaming 64 requests
# token by token: 172 -> 98-108 us of CPU an output token (benchmarks/RESULTS.md)
SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
             "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def set_serve_env() -> None:
    """Sets this process's environment for the Serve controller of a Ray it starts next (Ray's
    processes inherit it; the environment's own values win)."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)


def deploy(config: AppConfig, app_name: str = "shardserve") -> None:
    """Runs the application and its /health application; returns once both are running (they
    start side by side: the health replica's start no longer waits for the model's)."""
    serve.run_many([
        serve.RunTarget(build_app(config), name=app_name, route_prefix="/"),
        serve.RunTarget(build_health_app(app_name), name=health_app_name(app_name),
                        route_prefix=HEALTH_ROUTE)])


def undeploy(app_name: str = "shardserve", timeout_s: float = 60.0) -> None:
    """Deletes both from a cluster that serves other applications too, side by side (one after
    the other each waited out its replicas' ~2 s graceful stop)."""
    names = (health_app_name(app_name), app_name)
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while set(names) & set(serve.status().applications):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{names} were not deleted within {timeout_s:.0f} s")
        time.sleep(0.1)


def app_builder(args: dict[str, Any]) -> Application:
    return build_app(AppConfig.from_args(args))
