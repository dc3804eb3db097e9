"""Frames <-> the Qwen2-VL family's flat patch rows, in numpy.

Owns the patch layout of transformers' Qwen2-VL image and video processors (each row: one
patch_size x patch_size patch of every channel over `temporal` frames; rows ordered by temporal
patch, then merge_size x merge_size block, then the patches in the block). The video processor
needs torchvision, which the CPU build here cannot install, so a video's frames go through the
model's image processor one by one (the same resize and normalisation an image gets), are taken
back out of its rows (`unpatchify`) and paired into temporal patches (`patchify`)."""

from __future__ import annotations

import numpy as np


def unpatchify(rows: np.ndarray, frames: int, grid: np.ndarray, patch: int, merge: int,
               temporal: int) -> np.ndarray:
    """The image processor's rows for `frames` images of one grid (1, h, w) -> the normalised
    frames [frames, C, H, W] (an image's rows hold it `temporal` times: the first is taken)."""
    _, h, w = (int(v) for v in grid)
    channels = rows.shape[1] // (temporal * patch * patch)
    blocks = rows.reshape(frames, h // merge, w // merge, merge, merge, channels, temporal, patch,
                          patch)[:, :, :, :, :, :, 0]
    # [frames, h/m, w/m, m, m, C, P, P] -> [frames, C, h/m, m, P, w/m, m, P]
    return blocks.transpose(0, 5, 1, 3, 6, 2, 4, 7).reshape(frames, channels, h * patch,
                                                            w * patch)


def patchify(video: np.ndarray, patch: int, merge: int,
             temporal: int) -> tuple[np.ndarray, np.ndarray]:
    """Frames [F, C, H, W] -> (rows [t*h*w, C*temporal*P*P] float32, grid (t, h, w)); the last
    frame is repeated to fill the final temporal patch."""
    if pad := -len(video) % temporal:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    frames, channels, height, width = video.shape
    t, h, w = frames // temporal, height // patch, width // patch
    blocks = video.reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge,
                           patch)
    # -> [t, h/m, w/m, m, m, C, temporal, P, P], as Qwen2VLVideoProcessor.patchify permutes
    rows = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(
        t * h * w, channels * temporal * patch * patch)
    return np.ascontiguousarray(rows, dtype=np.float32), np.array([t, h, w], dtype=np.int64)
