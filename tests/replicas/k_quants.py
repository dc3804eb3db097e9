"""Test-side K-quant quantizers (gguf-py has none): float weights -> Q4_K and Q6_K rows in
llama.cpp's byte layout, for GGUF files the loader and kernel tests write."""

from __future__ import annotations

import numpy as np


def q4_k(w: np.ndarray) -> np.ndarray:
    """float [n, k] (k a multiple of 256) -> Q4_K rows, a plain min/max quantizer (gguf-py has
    no K-quant quantizer; llama.cpp's searches its scales, which changes no byte's meaning):
    per 32 weights a 6-bit scale and min under the super-block's float16 d and dmin."""
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / 15, -low
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc
    q = np.round((sub + (dmin.astype(np.float32) * m)[..., None])
                 / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, k // 256, 4, 2, 32)
    qs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # sub-block 2i low nibbles, 2i + 1 high
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                             m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8)
                             .reshape(n, -1, 2), scales, qs.reshape(n, k // 256, 128)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def q6_k(w: np.ndarray) -> np.ndarray:
    """float [n, k] (k a multiple of 256) -> Q6_K rows, a plain absmax quantizer: per 16 weights
    an int8 scale under the super-block's float16 d, quants q - 32 in -32..31, laid out as
    llama.cpp's (element 128n + 32j + l: ql[64n + 32 (j % 2) + l]'s nibble j // 2, qh[32n + l]'s
    bits 2j and 2j + 1)."""
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n, k // 256, 16, 16)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = peak / -32  # as llama.cpp: the largest-magnitude weight becomes q - 32 = -32
    d = (np.abs(scale).max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), -128, 127)
    step = d.astype(np.float32) * sc
    q = np.clip(np.round(sub / np.where(step != 0, step, 1)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 2, 2, 32)  # [n][j // 2][j % 2][l]
    ql = (q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)  # [n][j % 2][l]
    hi = (q >> 4).reshape(n, k // 256, 2, 4, 32)
    qh = sum(hi[:, :, :, j] << (2 * j) for j in range(4)).astype(np.uint8)
    blocks = np.concatenate([ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64),
                             sc.astype(np.int8).view(np.uint8),
                             d.view(np.uint8).reshape(n, -1, 2)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))
