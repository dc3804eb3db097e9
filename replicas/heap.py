"""The collector and the engine core's startup heap.

The engine core allocates ~400,000 objects while it starts (the libraries' modules, the model's
modules and config, the tokenizer) that live as long as it does. Every oldest-generation
collection walked all of them, and the engine's steps allocate thousands of short-lived tuples
each, so such a pass came every few steps, inside one. `freeze_startup_heap`, called once the core
is ready to serve, moves them into the permanent generation the collector skips, as vLLM's engine
core does; what is allocated afterwards is collected as before. (The ingress did not gain from the
same: 64 streams token by token, 130-153 against 125-148 us of its CPU a token, AMD EPYC Zen 4.)"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects what starting left unreachable, then freezes the rest; returns how many objects
    were frozen. The engine loop warm at 256 rows (forward replaced by fixed logits; bench-135m;
    AMD EPYC Zen 4): `_launch` 1.66-1.70 ms a step on average against a 1.04 median before,
    1.03-1.08 (its median) after."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
