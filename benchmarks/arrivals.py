"""When each request is sent: send offsets (seconds from the benchmark start) for an open-loop
arrival process. Poisson is gamma with shape 1; other shapes change burstiness at the same mean."""

from __future__ import annotations

import math

import numpy as np


def send_offsets(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int | None = 0,
) -> np.ndarray:
    """Return ``num_requests`` non-decreasing send times in seconds, the first at 0.

    Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean
    ``1 / request_rate``: shape 1 is a Poisson process, < 1 is burstier, > 1 is more uniform.
    ``request_rate`` of ``inf`` sends everything at once.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    # scale = mean / shape keeps the mean gap at 1/rate whatever the shape.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))
