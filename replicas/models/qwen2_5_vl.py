"""Qwen2.5-VL (HF `model_type` "qwen2_5_vl"): a windowed-attention vision transformer and a patch
merger in front of our Qwen2 decoder, whose rotary positions are 3-D (M-RoPE).

Owns the vision side and M-RoPE. `encode` turns images (the image processor's flattened patch
rows and each image's `image_grid_thw`) into rows of the decoder's embedding space, exactly as
transformers' `get_image_features` does: a Conv3d patch embedding, blocks with 2-D rotary
attention (within windows of `window_size` pixels, or over the whole image in the
`fullatt_block_indexes` blocks), and the merger (RMSNorm, spatial_merge_size^2 patches -> one
row, two linears). All of a step's images run through the tower as one sequence; attention never
crosses an image. The tower is plain torch, replicated on every tensor-parallel rank, never
packed nor quantized. The decoder is `LlamaForCausalLM` built from `config.text_config` (Qwen2's
layers) with `MRotaryEmbedding` swapped in: its positions are [3, T] (temporal, height, width),
which the runner builds from `RowInput.mrope` (a text token's three are equal, so text alone
rotates exactly as 1-D RoPE does). The cos/sin it hands the layers have the 1-D layout, so the
Python layers and the native CPU layers run unchanged.

`image_tokens(grid_thw, config)` says how many placeholder tokens an image takes."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from replicas.models.llama import LlamaForCausalLM, RMSNorm
from replicas.models.multimodal import MultimodalModel
from replicas.models.llava import _activation
from replicas.models.rope import RotaryEmbedding, apply_rotary

_DECODERS = ("qwen2_5_vl_text", "qwen2_vl_text", "qwen2")
_VISION_EPS = 1e-6  # transformers hardcodes the tower's and the merger's RMSNorm eps


def image_tokens(grid_thw: tuple[int, int, int] | np.ndarray, config: PretrainedConfig) -> int:
    """Placeholder tokens (= encoder rows) of an image whose patch grid is (t, h, w)."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // config.vision_config.spatial_merge_size ** 2


def mrope_section(config: PretrainedConfig) -> list[int]:
    """How many of the head's frequency pairs rotate by the temporal, height and width position
    (transformers 5 keeps it in `rope_parameters`, older versions in `rope_scaling`)."""
    for name in ("rope_parameters", "rope_scaling"):
        section = (getattr(config, name, None) or {}).get("mrope_section")
        if section:
            return [int(s) for s in section]
    raise ValueError("the decoder's config has no mrope_section (rope_parameters or rope_scaling)")


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: frequency pair i rotates by the position on axis `axis[i]` (the first
    mrope_section[0] pairs by the temporal one, the next by height, the rest by width), as
    transformers' Qwen2.5-VL rotary embedding interleaves them. Same tables, same output layout
    as `RotaryEmbedding`, one gather more."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        section = mrope_section(config)
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
        self.axis = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
        self.columns = torch.arange(head_dim // 2)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> [T, 1, D/2] cos and sin."""
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions are [3, tokens], got {tuple(positions.shape)}")
        if self.cos.device != positions.device:
            device = positions.device
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
            self.axis, self.columns = self.axis.to(device), self.columns.to(device)
        # [T, D/2]: token t's pair i reads the table at its position on pair i's axis (built
        # row-major: the gathers then come out contiguous, as the native kernels want them)
        index = positions.T[:, self.axis]
        return (self.cos[index, self.columns].unsqueeze(1).to(dtype),
                self.sin[index, self.columns].unsqueeze(1).to(dtype))


class PatchEmbed(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.hidden = config.hidden_size
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each row is one whole kernel window (C, T, P, P flattened in the weight's order): the
        # convolution is a matmul, which CPUs run far faster than a Conv3d of 1x1x1 outputs
        return F.linear(x, self.proj.weight.view(self.hidden, -1))


class VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                segments: list[torch.Tensor]) -> torch.Tensor:
        """segments: index tensors [n, L] of rows that attend among themselves (windows or
        images), grouped by length so that each group is one batched attention call."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        # rotated in float32, as transformers does whatever the model's dtype
        q = apply_rotary(q.float(), *rope).to(x.dtype)
        k = apply_rotary(k.float(), *rope).to(x.dtype)
        out = torch.empty_like(q)
        for index in segments:
            # [groups, L, heads, d] -> [groups, heads, L, d]
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
            out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.view(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.act = _activation(config.hidden_act)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, _VISION_EPS)
        self.norm2 = RMSNorm(config.hidden_size, _VISION_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                segments: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.hidden = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, _VISION_EPS)
        # `mlp.0` and `mlp.2` as in checkpoints (GELU between them)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def _segments(lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """Consecutive runs of rows of `lengths` -> index tensors [runs, L], one per distinct L."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts.tolist(), lengths):
        if length:
            by_length.setdefault(length, []).append(start)
    return [(torch.tensor(s)[:, None] + torch.arange(length)).to(device)
            for length, s in by_length.items()]


class VisionTransformer(nn.Module):
    """Qwen2.5-VL's vision tower (names as in HF checkpoints under `visual.`)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window_size = config.window_size
        self.fullatt = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        # the axial 2-D rope: half of the head's frequency pairs per axis, height's then width's
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def _layout(self, grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray,
                                                                  list[int], list[int]]:
        """For patches in the processor's order: the (h, w) position of each patch, the window
        order of the merged units (transformers' window_index), and the lengths of the windows
        and of the full-attention segments (one per image frame) in that order."""
        m, unit = self.merge, self.merge ** 2
        cells = self.window_size // m // self.patch_size  # merged units per window side
        positions, order, windows, frames = [], [], [], []
        base = 0
        for t, h, w in grids:
            hh, ww = h // m, w // m
            # patches come in m x m blocks (a merged unit's), block rows first
            grid = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            hw = np.stack([g.reshape(hh, m, ww, m).transpose(0, 2, 1, 3).ravel() for g in grid], 1)
            positions.append(np.tile(hw, (t, 1)))
            units = np.arange(t * hh * ww).reshape(t, hh, ww)
            for frame in units:
                for r in range(0, hh, cells):
                    for c in range(0, ww, cells):
                        window = frame[r:r + cells, c:c + cells].ravel()
                        order.append(window + base)
                        windows.append(window.size * unit)
            frames.extend([h * w] * t)
            base += t * hh * ww
        return np.concatenate(positions), np.concatenate(order), windows, frames

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [patches, C*T*P*P] of all images, grids their (t, h, w) -> merged rows
        [patches / merge^2, out hidden] in the same order."""
        positions, order, windows, frames = self._layout(grids)
        device, unit = pixels.device, self.merge ** 2
        # window order: each window's units consecutive, each unit's m x m patches consecutive
        perm = torch.from_numpy(order).to(device)
        patch_perm = (perm[:, None] * unit + torch.arange(unit, device=device)).view(-1)
        x = self.patch_embed(pixels)[patch_perm]
        hw = torch.from_numpy(positions).to(device)[patch_perm].float()
        # [n, head_dim / 2]: height's frequencies, then width's
        freqs = (hw[..., None] * self.inv_freq.to(device)).flatten(1)
        rope = (freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1))
        window_segments = _segments(windows, device)
        # a frame's patches stay consecutive in window order: windows never cross frames
        frame_segments = _segments(frames, device)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frame_segments if i in self.fullatt else window_segments)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[perm] = merged  # back to the processor's order
        return out


class Qwen2_5_VLForConditionalGeneration(MultimodalModel):
    modalities: frozenset[str] = frozenset({"image", "video"})
    uses_mrope = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        text = config.text_config
        if text.model_type not in _DECODERS:
            raise ValueError(f"Qwen2.5-VL decoder {text.model_type!r} is not supported; "
                             f"supported: {list(_DECODERS)}")
        if getattr(text, "use_sliding_window", False):
            raise ValueError("Qwen2.5-VL with use_sliding_window is not supported")
        self.config = config
        self.visual = VisionTransformer(config.vision_config)
        # Qwen2's layers (q/k/v biases), head_dim = hidden / heads as transformers' attention
        # computes it whatever the config says
        decoder = copy.deepcopy(text)
        decoder.model_type = "qwen2"
        decoder.head_dim = text.hidden_size // text.num_attention_heads
        self.language_model = LlamaForCausalLM(decoder)
        self.language_model.rope = MRotaryEmbedding(decoder, decoder.head_dim)
        # transformers ties on the top config, which takes the text config's flag up
        self.tie_word_embeddings = (bool(getattr(config, "tie_word_embeddings", False))
                                    or bool(getattr(text, "tie_word_embeddings", False)))

    @torch.no_grad()
    def encode(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each item's embedding rows [t*h*w / merge^2, text hidden] in the decoder's dtype; all
        items run through the tower as one sequence."""
        if modality not in self.modalities:
            raise ValueError(f"Qwen2.5-VL encodes images and videos, not {modality!r}")
        vision = self.config.vision_config
        width = (vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
        grids = []
        for item in items:
            # a video is a grid of t > 1 temporal patches through the same tower
            grid = tuple(int(v) for v in np.asarray(item[f"{modality}_grid_thw"]).reshape(-1))
            pixels = item["pixel_values"]
            if (len(grid) != 3 or grid[1] % vision.spatial_merge_size
                    or grid[2] % vision.spatial_merge_size
                    or pixels.shape != (grid[0] * grid[1] * grid[2], width)):
                raise ValueError(f"an image must be its grid's t*h*w patch rows of {width} values "
                                 f"(h and w multiples of {vision.spatial_merge_size}), got "
                                 f"{pixels.shape} for image_grid_thw {grid}")
            grids.append(grid)
        weight = self.visual.merger.mlp[0].weight
        pixels = torch.from_numpy(np.concatenate([item["pixel_values"] for item in items]))
        rows = self.visual(pixels.to(weight.device, weight.dtype), grids)
        return list(rows.split([image_tokens(g, self.config) for g in grids]))

    def checkpoint_name(self, name: str) -> tuple[str, int]:
        """Maps an HF checkpoint tensor name to (our parameter name, shard index), in both
        layouts: transformers >= 4.52 loaded (`model.language_model.layers...`, `model.visual...`,
        `lm_head.weight`) and the older one, which the Qwen2.5-VL checkpoints ship and
        transformers 5 still saves (`model.layers...`, `visual...`, `lm_head.weight`). Decoder
        names go through the decoder's own mapping (fused qkv and gate/up shards)."""
        name = name.removeprefix("model.")
        if name.startswith("visual."):
            return name, 0
        target, shard = self.language_model.checkpoint_name(name.removeprefix("language_model."))
        return "language_model." + target, shard
