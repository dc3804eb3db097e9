"""AppConfig / ModelConfig: the server's configuration, from the CLI, a YAML file or the builder
args of `serve run serve_config.yaml`. Pydantic with extra="forbid", so a typo is an error."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.deployment import ReplicaConfig
from replicas.embedded import EMBEDDED_MODEL_ID


class AutoscalingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # passed through to Ray Serve as is
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = EMBEDDED_MODEL_ID
    served_model_name: str | None = None
    max_model_len: int | None = Field(None, ge=16)
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$")
    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: AutoscalingConfig | None = None
    block_size: int = Field(16, ge=1)
    kv_cache_gib: float = Field(0.5, gt=0)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    max_waiting: int = Field(1024, ge=1)
    enable_prefix_caching: bool = True
    priority_scheduling: bool = False
    num_threads: int = Field(0, ge=0)
    replica_num_cpus: float = Field(1.0, ge=0)
    shard_num_cpus: float = Field(0.5, ge=0)
    shard_num_gpus: float = Field(0.0, ge=0)
    # extra resources each shard bundle asks for (e.g. {"accelerator_type:H100": 0.001}), which
    # pins shards to the nodes that advertise them
    shard_resources: dict[str, float] = Field(default_factory=dict)
    placement_group_strategy: str = Field("STRICT_PACK", pattern="^(STRICT_PACK|PACK|SPREAD|STRICT_SPREAD)$")
    max_ongoing_requests: int = Field(256, ge=1)
    # prefix-aware routing keeps a request on the replica with its prefix unless that replica
    # has this many more requests in flight than the least loaded one
    routing_imbalance: int = Field(8, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    structured_timeout_s: float = Field(10.0, gt=0)  # the compile limit of one constraint
    # tokens per streamed message after the first (vLLM's --stream-interval); 1: every token
    stream_interval: int = Field(1, ge=1)
    # the replica's streamed messages per second, shared by its running requests (0: no limit;
    # None: 500 on GPUs, 150 on CPUs)
    stream_messages_per_s: float | None = Field(None, ge=0)
    enforce_eager: bool = False

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def replica_config(self, logits_processors: list[str] | None = None) -> ReplicaConfig:
        return ReplicaConfig(
            logits_processors=tuple(logits_processors or ()),
            structured_timeout_s=self.structured_timeout_s, stream_interval=self.stream_interval,
            stream_messages_per_s=self.stream_messages_per_s,
            enforce_eager=self.enforce_eager,
            model=self.model, max_model_len=self.max_model_len, dtype=self.dtype,
            tensor_parallel_size=self.tensor_parallel_size, block_size=self.block_size,
            kv_cache_gib=self.kv_cache_gib, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_waiting=self.max_waiting,
            enable_prefix_caching=self.enable_prefix_caching,
            priority_scheduling=self.priority_scheduling, num_threads=self.num_threads,
            shard_num_cpus=self.shard_num_cpus, shard_num_gpus=self.shard_num_gpus)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelConfig] = Field(default_factory=lambda: [ModelConfig()], min_length=1)
    api_key: str | None = Field(default_factory=lambda: os.environ.get("SHARDSERVE_API_KEY"))
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    ingress_num_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.25, ge=0)
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    max_n: int = Field(16, ge=1)
    logits_processors: list[str] = Field(default_factory=list)
    request_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _unique_names(self) -> "AppConfig":
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique, got {names}")
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "AppConfig":
        """Builder args (from `serve run`): either AppConfig fields, or ModelConfig fields for a
        single model at the top level."""
        model_fields = set(ModelConfig.model_fields)
        if "models" in args or not (set(args) & model_fields):
            return cls.model_validate(args)
        app_args = {k: v for k, v in args.items() if k not in model_fields}
        app_args["models"] = [{k: v for k, v in args.items() if k in model_fields}]
        return cls.model_validate(app_args)
