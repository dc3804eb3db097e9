"""Shared by the multimodal models' parity tests: images made from a ramp, a worker on a small
paged cache, the encoder slices of a prompt's tokens (the engine's own function), a count of the
model's encode calls, and the checks of both checkpoint layouts' tensor names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from replicas.model_runner import RowInput, StepInput
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


def assert_checkpoint_names(model: Any, names: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """Each checkpoint tensor name maps to (our parameter, shard) and that parameter exists;
    returns the model's parameters by name."""
    params = dict(model.named_parameters())
    for name, expected in names.items():
        assert model.checkpoint_name(name) == expected, name
        assert expected[0] in params
    return params


def resave_renamed(folder: Path, to: Path, rename: Callable[[str], str]) -> dict[str, Any]:
    """`folder`'s configs and weights saved into `to` under rename(name) (a checkpoint of the
    other layout); returns the original tensors by name."""
    for name in ("config.json", "generation_config.json"):
        (to / name).write_bytes((folder / name).read_bytes())
    tensors = load_file(folder / "model.safetensors")
    save_file({rename(n): t for n, t in tensors.items()}, to / "model.safetensors")
    return tensors


def assert_same_logits(a: Path, b: Path, row: RowInput) -> None:
    """The two checkpoints give bit-identical logits for one row."""
    first, second = (worker(f).execute(StepInput((row,))).logits for f in (a, b))
    assert torch.equal(first, second)
