"""Open-loop arrival schedules: mean rate, burstiness, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.arrivals import send_offsets


def test_poisson_mean_rate_and_exponential_gaps() -> None:
    offsets = send_offsets(20001, request_rate=10.0, burstiness=1.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert np.all(gaps >= 0)
    assert len(gaps) / offsets[-1] == pytest.approx(10.0, rel=0.03)
    # Exponential gaps have a coefficient of variation of 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_mean_and_sets_variability(burstiness: float) -> None:
    gaps = np.diff(send_offsets(20001, request_rate=5.0, burstiness=burstiness, seed=2))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.07)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert send_offsets(5, math.inf).tolist() == [0.0] * 5


def test_seeded_and_validated() -> None:
    assert send_offsets(50, 3.0, 1.0, seed=7).tolist() == send_offsets(50, 3.0, 1.0, seed=7).tolist()
    assert send_offsets(50, 3.0, 1.0, seed=7).tolist() != send_offsets(50, 3.0, 1.0, seed=8).tolist()
    assert send_offsets(0, 3.0).size == 0
    for kwargs in ({"request_rate": 0.0}, {"request_rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            send_offsets(3, **kwargs)
