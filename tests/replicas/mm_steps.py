"""Shared by the multimodal models' parity tests: images made from a ramp, a worker on a small
paged cache, the encoder slices of a prompt's tokens (the engine's own function), and a count
of the model's encode calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from replicas.model_runner import encoder_slices as slices  # noqa: F401 (the tests' name)
from replicas.worker import ShardWorker, WorkerConfig

BLOCK = 4
TOL = {"atol": 1e-4, "rtol": 1e-4}


def gradient(rgb: tuple[int, int, int], size: tuple[int, int],
             vertical: bool = False) -> Image.Image:
    """A ramp from black to `rgb`, `size` = (width, height)."""
    w, h = size
    ramp = np.linspace(0.0, 1.0, h if vertical else w)
    ramp = ramp[:, None] if vertical else ramp[None, :]
    pixels = np.broadcast_to(ramp, (h, w))[..., None] * np.array(rgb, dtype=np.float64)
    return Image.fromarray(pixels.astype(np.uint8))


def worker(folder: Path, attention: str = "native", num_blocks: int = 64) -> ShardWorker:
    w = ShardWorker(WorkerConfig(str(folder), "float32", num_blocks=num_blocks, block_size=BLOCK))
    if attention == "torch":
        w.runner.native_decode = w.runner.native_prefill = False
    return w


def count_encodes(w: ShardWorker) -> list[int]:
    """Wraps the model's `encode`: each call appends how many items it encoded."""
    calls: list[int] = []
    encode = w.runner.model.encode

    def counted(modality: str, items: list) -> list[torch.Tensor]:
        calls.append(len(items))
        return encode(modality, items)

    w.runner.model.encode = counted
    return calls
