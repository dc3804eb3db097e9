"""The ingress's Prometheus registry (no Ray): the engines' reports summed into its series."""

from __future__ import annotations

from serve_app.metrics import Metrics


def _series(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_step_kinds_sum_over_replicas() -> None:
    metrics = Metrics()
    reports = [{"num_steps": 10, "decode_steps": 8, "decode_step_s": 0.4, "prefill_steps": 2,
                "prefill_step_s": 0.5, "held_steps": 3},
               {"num_steps": 5, "decode_steps": 5, "decode_step_s": 0.1,
                "steps_scheduled_ahead": 4},  # no prefill yet
               {}]  # a core that is starting
    metrics.set_engine_stats("m", reports)
    got = _series(metrics.render().decode())
    label = '{model_name="m"}'
    assert got["shardserve:engine_steps_total" + label] == 15
    assert got["shardserve:engine_decode_steps_total" + label] == 13
    assert abs(got["shardserve:engine_decode_step_seconds_total" + label] - 0.5) < 1e-9
    assert got["shardserve:engine_prefill_steps_total" + label] == 2
    assert got["shardserve:engine_prefill_step_seconds_total" + label] == 0.5
    assert got["shardserve:scheduler_held_steps_total" + label] == 3
    assert got["shardserve:engine_steps_scheduled_ahead_total" + label] == 4
