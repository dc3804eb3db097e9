"""What a model replica is configured with (ReplicaConfig, from the app's config) and what its
engine-core process is started with (CoreSpec): plain frozen dataclasses, so the replica's front,
which starts and supervises the core, imports neither torch nor the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaConfig:
    model: str
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # engine_core.resolve_kv_cache_dtype
    tensor_parallel_size: int = 1
    block_size: int = 16
    # None: on GPUs what gpu_memory_utilization leaves once the weights are loaded, on CPUs
    # 0.5 GiB (replicas/kv_budget.py)
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    priority_scheduling: bool = False
    num_threads: int = 0  # 0: every core of the node
    shard_num_cpus: float = 0.5
    shard_num_gpus: float = 0.0
    logits_processors: tuple[str, ...] = ()  # the allowlist: qualified names
    structured_timeout_s: float = 10.0
    # the core's forward runs in a thread that takes the GIL back between torch ops; with
    # Python's default 5 ms switch interval, every time the core's event loop thread holds it
    # the forward stalls for up to 5 ms
    gil_switch_interval_s: float | None = 0.0005
    # the budget of streamed messages (SSE events) per second each ingress applies to its
    # streams of this model (serve_app/channels.py; the replica works out the default and
    # reports it): each waits at least streams / budget seconds between messages (the first
    # token and the last go at once); with few streams or slow steps it changes nothing. 0:
    # off. None: 500 where the model runs on GPUs, 50 on CPUs, where each event costs the
    # ingress CPU time out of the cores the engine computes on
    stream_messages_per_s: float | None = None
    # the least wait between two of one request's streamed messages, which the engine core
    # honours too (replicas/output_pacer.py); None: 40 ms on CPUs under the default budget, else 0
    stream_floor_s: float | None = None
    # vLLM's --enforce-eager: no CUDA graphs (they apply on CUDA at tp 1)
    enforce_eager: bool = False
    # decode-only steps new sequences may sit out to join together (replicas/scheduler.py);
    # None: 4 where steps replay CUDA graphs, else 0
    max_waiting_steps: int | None = None
    # vLLM's --async-scheduling: each step is scheduled while the one before it runs
    # (replicas/engine.py, Engine._launch_ahead); off unless asked for: served, it measured
    # slower on CPUs and on an H200 (benchmarks/RESULTS.md)
    async_scheduling: bool = False
    # the front kills and restarts a core whose step has run this long (a hung forward) or that
    # has sent nothing for `core_silence_s` (its process is wedged)
    step_timeout_s: float = 120.0
    core_silence_s: float = 15.0
    # weight-only quantization of a float checkpoint's linears ("int8": Q8_0 blocks, on CPUs)
    quantization: str | None = None
    # the core process's niceness (None: as inherited). Ray starts its workers, and so the
    # replica that starts the core, at 15, below its own daemons (0). A core at 15 is preempted
    # mid-step by every wake-up of the serving processes beside it, and one preempted OpenMP
    # thread stalls its team at the next barrier: one stream's decode step took 2.15x the same
    # core's step alone. One stream's TPOT on bench-135m, 2 cores, by the core's niceness with
    # the replicas at 15: 0: 13.0-13.7 ms, 5: 14.2, 10: 14.9-15.2, 15: 17.4-21.3. At 0 the
    # ingress (at 15) got too little of the cores under load: new streams beside a busy one
    # were admitted tens of steps late (tests/reliability/test_caps.py). 5 keeps most of the
    # gain and the ingress's share. Lowering a niceness needs CAP_SYS_NICE or RLIMIT_NICE;
    # without them it stays as it is (logged).
    core_niceness: int | None = 5

    def stream_pace(self, on_gpu: bool) -> tuple[float, float]:
        """(the message budget each ingress applies to its streams of this model, 0: none; the
        floor). By default on CPUs a request alone still waits 40 ms between messages (25 a
        second, below what a reader sees): each costs the ingress, the front and the core CPU
        time taken from the engine's cores (one stream's TPOT 10.8 -> 9.3 ms)."""
        default = self.stream_messages_per_s is None
        budget = (500.0 if on_gpu else 50.0) if default else self.stream_messages_per_s
        floor = self.stream_floor_s
        if floor is None:
            floor = 0.04 if default and not on_gpu else 0.0
        return budget, floor


@dataclass(frozen=True)
class CoreSpec:
    """What a core process is started with: the config, and at tp > 1 how to reach Ray."""

    config: ReplicaConfig
    name: str  # the served model's name, for `ps`
    ray_address: str | None = None
    ray_namespace: str | None = None
    runtime_env: dict | None = None
    # the replica's group: ranks 1..N-1 take bundles 1..N-1
    placement_group_id: bytes | None = None
    shard_name_prefix: str | None = None
