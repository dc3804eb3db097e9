"""AppConfig / ModelConfig: the server's configuration, from the CLI, a YAML file or the builder
args of `serve run serve_config.yaml`. Pydantic with extra="forbid", so a typo is an error."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.deployment import ReplicaConfig
from replicas.embedded import DEFAULT_MODEL_ID


def _split_keys(value: str) -> list[str]:
    return [k.strip() for k in value.split(",") if k.strip()]


class AutoscalingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # passed through to Ray Serve as is
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = DEFAULT_MODEL_ID
    # with `model` a folder: the .gguf file in it to serve (else a .gguf path goes in `model`)
    gguf_file: str | None = None
    # sampling defaults for fields a request omits (serve_app/generation_defaults.py)
    generation_config: str = "auto"
    # weight-only quantization of a float checkpoint's linears on CPUs (Q8_0 blocks)
    quantization: Literal["int8"] | None = None
    served_model_name: str | None = None
    max_model_len: int | None = Field(None, ge=16)
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$")
    # the KV cache's element type: "auto" is the compute dtype, but bfloat16 where --dtype auto
    # computes a 16-bit or quantized checkpoint in float32 on a CPU (engine_core.py)
    kv_cache_dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$")
    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: AutoscalingConfig | None = None
    block_size: int = Field(16, ge=1)
    # None: on GPUs, what gpu_memory_utilization of each GPU leaves once the weights are loaded
    # (vLLM's sizing); on CPUs 0.5 GiB. Either way capped at every sequence slot full-length
    kv_cache_gib: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    # sequences the engine queues before it answers 503: with max_num_seqs running, the bound on
    # what one replica holds (a burst beyond it is shed at once instead of waiting)
    max_waiting: int = Field(256, ge=1)
    enable_prefix_caching: bool = True
    priority_scheduling: bool = False
    num_threads: int = Field(0, ge=0)
    replica_num_cpus: float = Field(1.0, ge=0)
    shard_num_cpus: float = Field(0.5, ge=0)
    shard_num_gpus: float = Field(0.0, ge=0)
    # extra resources the model's ranks ask for (e.g. {"accelerator_type:H100": 0.001}): the
    # replica (its engine core computes rank 0) and each other rank's bundle; it pins them to
    # the nodes that advertise them
    shard_resources: dict[str, float] = Field(default_factory=dict)
    placement_group_strategy: str = Field("STRICT_PACK", pattern="^(STRICT_PACK|PACK|SPREAD|STRICT_SPREAD)$")
    # Ray Serve's own bounds on the replica deployment; None: from the engine's capacity
    # (max_num_seqs + max_waiting requests in the replica, max_num_seqs more queued per caller)
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=0)
    # prefix-aware routing keeps a request on the replica with its prefix unless that replica
    # has this many more requests in flight than the least loaded one
    routing_imbalance: int = Field(8, ge=0)
    health_check_period_s: float = Field(10.0, gt=0)
    structured_timeout_s: float = Field(10.0, gt=0)  # the compile limit of one constraint
    # tokens per streamed message after the first (vLLM's --stream-interval); 1: every token
    stream_interval: int = Field(1, ge=1)
    # each ingress's streamed messages (SSE events) per second for this model, shared by its
    # streaming requests (0: no limit; None: 500 on GPUs, 50 on CPUs)
    stream_messages_per_s: float | None = Field(None, ge=0)
    enforce_eager: bool = False
    # decode-only steps that new requests may wait for before they join the batch together
    # (TGI's max_waiting_tokens); None: 4 where the replica replays CUDA graphs, else 0
    max_waiting_steps: int | None = Field(None, ge=0)
    # vLLM's --async-scheduling: each engine step is scheduled while the one before it runs;
    # off unless asked for: served, it measured slower on CPUs (the loop's thread takes a core
    # from the forward's) and on an H200 (0.84x at 256 streams: benchmarks/RESULTS.md)
    async_scheduling: bool = False
    # the replica kills and restarts its engine core when a step runs this long (a hung
    # forward); raise it for huge prefill chunks on slow CPUs
    step_timeout_s: float = Field(120.0, gt=0)
    # the engine core process's niceness (replicas/replica_config.py says why 5; None: Ray's)
    core_niceness: int | None = Field(5, ge=-20, le=19)
    # the model family's tool-call and reasoning syntax (vLLM's --tool-call-parser and
    # --reasoning-parser names); None: detected from the chat template (serve_app/tool_formats.py,
    # serve_app/reasoning_formats.py); reasoning "none": the output is never split
    tool_call_parser: Literal["hermes", "qwen3_coder", "llama3_json", "mistral",
                              "deepseek_v3"] | None = None
    reasoning_parser: Literal["qwen3", "deepseek_r1", "none"] | None = None

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def checkpoint(self) -> str:
        """What the model files are resolved from: `model`, or its `gguf_file`."""
        return os.path.join(self.model, self.gguf_file) if self.gguf_file else self.model

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.max_ongoing_requests or self.max_num_seqs + self.max_waiting

    @property
    def replica_max_queued_requests(self) -> int:
        return (self.max_queued_requests if self.max_queued_requests is not None
                else self.max_num_seqs)

    @property
    def max_replicas(self) -> int:
        if self.autoscaling_config is not None:
            return self.autoscaling_config.max_replicas
        return self.num_replicas

    def replica_config(self, logits_processors: list[str] | None = None) -> ReplicaConfig:
        return ReplicaConfig(
            logits_processors=tuple(logits_processors or ()),
            structured_timeout_s=self.structured_timeout_s,
            stream_messages_per_s=self.stream_messages_per_s,
            enforce_eager=self.enforce_eager, max_waiting_steps=self.max_waiting_steps,
            async_scheduling=self.async_scheduling,
            step_timeout_s=self.step_timeout_s, core_niceness=self.core_niceness,
            model=self.checkpoint, max_model_len=self.max_model_len, dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
            tensor_parallel_size=self.tensor_parallel_size, block_size=self.block_size,
            kv_cache_gib=self.kv_cache_gib, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_waiting=self.max_waiting,
            enable_prefix_caching=self.enable_prefix_caching,
            priority_scheduling=self.priority_scheduling, num_threads=self.num_threads,
            shard_num_cpus=self.shard_num_cpus, shard_num_gpus=self.shard_num_gpus)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelConfig] = Field(default_factory=lambda: [ModelConfig()], min_length=1)
    # accepted keys; also SHARDSERVE_API_KEY (comma-separated) and a file of one key a line
    # (api_key_file or SHARDSERVE_API_KEY_FILE, read by the ingress: keys stay out of `ps`)
    api_keys: list[str] = Field(default_factory=lambda: _split_keys(
        os.environ.get("SHARDSERVE_API_KEY", "")))
    api_key_file: str | None = Field(
        default_factory=lambda: os.environ.get("SHARDSERVE_API_KEY_FILE") or None)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    ingress_num_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.25, ge=0)
    # the ingress's niceness while it refuses requests for want of room, until 2 s after the
    # last refusal (None: never changed); serving, it stays at Ray's 15 (replicas/niceness.py)
    front_niceness: int | None = Field(5, ge=-20, le=19)
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    max_n: int = Field(16, ge=1)
    logits_processors: list[str] = Field(default_factory=list)
    request_timeout_s: float = Field(600.0, gt=0)
    # a request not scheduled by the engine this long after it arrived gets a 503 (Retry-After)
    max_queue_wait_s: float = Field(30.0, gt=0)
    # concurrent generation requests one API key may have in flight (429 beyond); None: no limit
    max_requests_per_key: int | None = Field(None, ge=1)
    # per-request `chat_template`s are refused unless trusted (vLLM's
    # --trust-request-chat-template); trusted ones render in a killable worker process
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = Field(5.0, gt=0)
    max_rendered_prompt_chars: int = Field(4 * 2**20, ge=1024)
    # SIGTERM/Ctrl-C: new requests 503 while in-flight ones get this long to finish
    shutdown_grace_s: float = Field(10.0, ge=0)
    # media in chat messages (multimodal models; serve_app/media.py): items per prompt by
    # modality (vLLM's --limit-mm-per-prompt), where URLs may point, how much is fetched
    # (8 for a modality it does not name)
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=dict)
    allowed_media_domains: list[str] | None = None  # None: any public host
    allow_private_media_urls: bool = False
    allowed_local_media_path: str | None = None  # file:// URLs only beneath it
    media_fetch_timeout_s: float = Field(10.0, gt=0)
    max_media_bytes: int = Field(20 * 2**20, ge=1024)
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    # image_embeds / audio_embeds parts (precomputed encoder output) accepted (vLLM's flag)
    enable_mm_embeds: bool = False

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
