"""Prometheus metrics with vLLM's names (`vllm:...`), so existing vLLM dashboards work unchanged.

Request-level histograms are observed in the ingress; engine gauges (running, waiting, KV-cache
usage) and token counters come from the replicas' latest reports on the status board, summed over
a model's replicas at scrape time. Every queue has a gauge: the ingress's admitted requests
(`shardserve:ingress_requests_in_flight` against `shardserve:ingress_admission_limit`), the
engines' running and waiting sequences; and every refusal is counted by reason
(`shardserve:requests_rejected_total`)."""

from __future__ import annotations

import collections

import time
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._engine_rejected: dict[str, dict[str, float]] = {}
        label = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Sequences running", label, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting", label, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", label,
                              registry=r)
        self.prompt_tokens = Gauge("vllm:prompt_tokens_total", "Prompt tokens computed", label,
                                   registry=r)
        self.generation_tokens = Gauge("vllm:generation_tokens_total", "Tokens generated", label,
                                       registry=r)
        self.preemptions = Gauge("vllm:num_preemptions_total", "Preemptions", label, registry=r)
        self.held_steps = Gauge("shardserve:scheduler_held_steps_total",
                                "Decode steps that new requests sat out (--max-waiting-steps)",
                                label, registry=r)
        self.ahead = Gauge("shardserve:engine_steps_scheduled_ahead_total",
                           "Engine steps scheduled while the step before them ran "
                           "(--async-scheduling)", label, registry=r)
        self.forced = Gauge("shardserve:jump_forward_tokens_total",
                            "Constrained tokens appended without a decode step of their own",
                            label, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests",
                               label + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", label,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token",
                              label, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", label,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                        label, buckets=(16, 64, 256, 1024, 4096, 16384),
                                        registry=r)
        self.request_generation = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", label,
            buckets=(16, 64, 256, 1024, 4096, 16384), registry=r)
        self.in_flight = Gauge("shardserve:ingress_requests_in_flight",
                               "Generation requests this ingress has admitted and not finished",
                               label, registry=r)
        self.admission_limit = Gauge("shardserve:ingress_admission_limit",
                                     "Generation requests this ingress admits before a 503",
                                     label, registry=r)
        self.replicas = Gauge("shardserve:replicas_reporting",
                              "Model replicas whose state reached the ingress recently", label,
                              registry=r)
        self.steps = Gauge("shardserve:engine_steps_total", "Engine steps", label, registry=r)
        # where the engine's time goes: steps that only decode, and steps that also prefill
        self.step_kinds = {
            kind: (Gauge(f"shardserve:engine_{kind}_steps_total",
                         f"Engine steps that {what}", label, registry=r),
                   Gauge(f"shardserve:engine_{kind}_step_seconds_total",
                         f"Seconds of engine steps that {what}", label, registry=r))
            for kind, what in (("decode", "only decode"), ("prefill", "also prefill"))}
        self.encoder = {
            key: Gauge(f"shardserve:{name}", what, label, registry=r)
            for key, name, what in (
                ("encoder_items", "encoder_items_total",
                 "Media items (images, audio clips, videos) the engines encoded"),
                ("encoder_s", "encoder_seconds_total", "Seconds the engines spent encoding"),
                ("encoder_cache_hits", "encoder_cache_hits_total",
                 "Media item lookups the encoder caches answered without encoding"))}
        self.stream_messages = Gauge("shardserve:replica_stream_messages_total",
                                     "Messages the replicas streamed to the ingress", label,
                                     registry=r)
        self.channeled = Gauge("shardserve:replica_channeled_requests_total",
                               "Requests whose tokens went over their ingress's channel (one "
                               "message per engine step for all its requests)", label, registry=r)
        self.core_restarts = Gauge("shardserve:engine_core_restarts_total",
                                   "Engine cores the replicas restarted (died or hung)", label,
                                   registry=r)
        self.model_info = Gauge("shardserve:model_info",
                                "Replicas reporting, by the dtype they compute in and the ISA "
                                "level of their CPU kernels (\"gpu\" on GPUs)",
                                label + ["dtype", "isa"], registry=r)
        self._info_labels: dict[str, set[tuple[str, str]]] = {}
        # counts, set from the ingress's and the engines' own counters at scrape time
        self.rejected = Gauge("shardserve:requests_rejected_total",
                              "Requests turned away (429/503), by reason", label + ["reason"],
                              registry=r)
        self.content_type = CONTENT_TYPE_LATEST

    def observe_first_token(self, model: str, started: float) -> None:
        self.ttft.labels(model).observe(time.monotonic() - started)

    def observe_request(self, model: str, started: float, states: list[Any],
                        prompt_len: int) -> None:
        elapsed = time.monotonic() - started
        self.e2e.labels(model).observe(elapsed)
        self.request_prompt.labels(model).observe(prompt_len)
        for st in states:
            n = len(st.token_ids)
            self.request_generation.labels(model).observe(n)
            if n > 1:
                self.tpot.labels(model).observe(elapsed / n)
            self.success.labels(model, st.finish_reason or "abort").inc()

    def set_engine_stats(self, model: str, reports: list[dict[str, Any]]) -> None:
        """From the model's replicas' latest reports (none: the gauges keep their values)."""
        self.replicas.labels(model).set(len(reports))
        if not reports:
            return

        def total(key: str) -> float:  # (a core that is starting has not reported them)
            return sum(r.get(key, 0) for r in reports)
        self.running.labels(model).set(total("num_running"))
        self.waiting.labels(model).set(total("num_waiting"))
        self.kv_usage.labels(model).set(total("kv_cache_usage") / len(reports))
        self.prompt_tokens.labels(model).set(total("prompt_tokens"))
        self.generation_tokens.labels(model).set(total("generation_tokens"))
        self.preemptions.labels(model).set(total("preemptions"))
        self.held_steps.labels(model).set(total("held_steps"))
        self.ahead.labels(model).set(total("steps_scheduled_ahead"))
        self.forced.labels(model).set(total("forced_tokens"))
        self.steps.labels(model).set(total("num_steps"))
        for kind, (steps, seconds) in self.step_kinds.items():
            steps.labels(model).set(total(f"{kind}_steps"))
            seconds.labels(model).set(total(f"{kind}_step_s"))
        for key, gauge in self.encoder.items():
            gauge.labels(model).set(total(key))
        self.stream_messages.labels(model).set(total("stream_messages"))
        self.channeled.labels(model).set(total("channeled_requests"))
        self.core_restarts.labels(model).set(total("core_restarts"))
        combos = collections.Counter((r["dtype"], r.get("isa") or "gpu") for r in reports
                                     if "dtype" in r)
        for gone in self._info_labels.get(model, set()) - set(combos):
            self.model_info.remove(model, *gone)
        for (dtype, isa), n in combos.items():
            self.model_info.labels(model, dtype, isa).set(n)
        self._info_labels[model] = set(combos)
        self._engine_rejected[model] = {
            "engine_queue_full": total("rejected_queue_full"),
            "queue_wait": total("rejected_queue_wait")}

    def set_admission(self, model: str, admission: Any) -> None:
        """The ingress's queue and its refusals (serve_app/admission.py), plus the engines'."""
        self.in_flight.labels(model).set(admission.in_flight[model])
        self.admission_limit.labels(model).set(admission.limits[model])
        counts: dict[str, float] = dict(self._engine_rejected.get(model, {}))
        for (m, reason), n in admission.rejected.items():
            if m == model:
                counts[reason] = counts.get(reason, 0) + n
        for reason, n in counts.items():
            self.rejected.labels(model, reason).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
