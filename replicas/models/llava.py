"""LLaVA (HF `model_type` "llava"): a CLIP or SigLIP vision tower and a projector in front of our
Llama-family decoder.

Owns the vision side: `encode` turns images (the HF image processor's normalized pixel values)
into rows of the decoder's embedding space, exactly as transformers' `get_image_features` does
(`vision_feature_layer`, int or list; `vision_feature_select_strategy` "default" drops the first
row, "full" keeps it); the runner hands them back to `forward` as `embeds`, which replace the
embeddings of the image's placeholder tokens. The decoder is `LlamaForCausalLM` built from
`config.text_config`, with its paged attention, native layers and tensor-parallel sharding. The
tower and the projector are plain torch layers, replicated on every tensor-parallel rank (each
rank encodes its step's images itself; only the decoder is sharded), never packed nor quantized.
The tower is built only up to the deepest layer the features read: the checkpoint's later layers
(and its post-layernorm, SigLIP's pooling head) are never loaded.

`image_placeholder(config)` says which token stands for an image and how many of them a prompt
holds per image, for the side that builds prompts without the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from replicas.models.llama import LlamaForCausalLM
from replicas.models.multimodal import MultimodalModel

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
_TOWERS = ("clip_vision_model", "siglip_vision_model")
_DECODERS = ("llama", "mistral", "qwen2", "qwen3")  # what LlamaForCausalLM implements


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class ImagePlaceholder:
    token_id: int  # the token that stands for one row of an image in the prompt
    tokens: int  # placeholder tokens (= encoder rows) per image
    image_size: int  # the square side the image processor resizes and crops to


def image_placeholder(config: PretrainedConfig) -> ImagePlaceholder:
    """For a LLaVA config: the image token and how many of them each image takes."""
    vision = config.vision_config
    tokens = (vision.image_size // vision.patch_size) ** 2
    if vision.model_type == "clip_vision_model":
        tokens += 1  # the class embedding's row
    if config.vision_feature_select_strategy == "default":
        tokens -= 1
    token_id = getattr(config, "image_token_id", None)
    if token_id is None:
        token_id = config.image_token_index
    return ImagePlaceholder(int(token_id), tokens, vision.image_size)


class VisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        clip = config.model_type == "clip_vision_model"
        # CLIP's convolution has no bias and a class embedding precedes the patches
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size, bias=not clip)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if clip else None
        patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(patches + int(clip), config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"images must be {self.image_size}x{self.image_size} (the image "
                             f"processor's crop), got {tuple(pixel_values.shape[-2:])}")
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.act = _activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))


class VisionTower(nn.Module):
    """CLIP's or SigLIP's vision transformer, its first `num_layers` layers (names as in HF
    checkpoints). CLIP adds a class embedding and a layernorm before the layers."""

    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                             if config.model_type == "clip_vision_model" else None)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states at `layers` (0: the embeddings, i: layer i's output), in that order."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in layers]


class Projector(nn.Module):
    def __init__(self, config: PretrainedConfig, in_features: int) -> None:
        super().__init__()
        hidden, bias = config.text_config.hidden_size, config.multimodal_projector_bias
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = _activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultimodalModel):
    modalities: frozenset[str] = frozenset({"image"})

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        if vision.model_type not in _TOWERS:
            raise ValueError(f"LLaVA vision tower {vision.model_type!r} is not supported; "
                             f"supported: {list(_TOWERS)}")
        if config.text_config.model_type not in _DECODERS:
            raise ValueError(f"LLaVA decoder {config.text_config.model_type!r} is not supported; "
                             f"supported: {list(_DECODERS)}")
        self.config = config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        depth = vision.num_hidden_layers
        if any(not -depth - 1 <= i <= depth for i in layers):
            raise ValueError(f"vision_feature_layer {config.vision_feature_layer} is outside the "
                             f"tower's {depth} layers")
        # transformers indexes hidden_states (embeddings + one per layer) like a Python list
        self.feature_layers = [i % (depth + 1) for i in layers]
        self.drop_first = config.vision_feature_select_strategy == "default"
        self.vision_tower = VisionTower(vision, max(self.feature_layers))
        self.multi_modal_projector = Projector(config, vision.hidden_size * len(layers))
        self.language_model = LlamaForCausalLM(config.text_config)
        # LlavaConfig copies the text config's flag up, and transformers ties on the top one
        self.tie_word_embeddings = (bool(getattr(config, "tie_word_embeddings", False))
                                    or self.language_model.tie_word_embeddings)

    @torch.no_grad()
    def encode(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each item's embedding rows [tokens per image, text hidden] in the decoder's dtype;
        images of one shape run through the tower as one batch."""
        if modality != "image":
            raise ValueError(f"LLaVA encodes images, not {modality!r}")
        weight = self.multi_modal_projector.linear_1.weight
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(tuple(item["pixel_values"].shape), []).append(i)
        out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
        for index in groups.values():
            pixels = torch.from_numpy(np.stack([items[i]["pixel_values"] for i in index]))
            rows = self._image_features(pixels.to(weight.device, weight.dtype))
            for i, r in zip(index, rows):
                out[i] = r
        return out

    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.drop_first:  # CLIP's class row (and, as transformers does, SigLIP's first patch)
            states = [s[:, 1:] for s in states]
        x = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        return self.multi_modal_projector(x)

    def checkpoint_name(self, name: str) -> tuple[str, int]:
        """Maps an HF checkpoint tensor name to (our parameter name, shard index), in both
        layouts: transformers >= 4.52 (`model.language_model.layers...`, `lm_head.weight`,
        `model.vision_tower.vision_model...`) and older ones (`language_model.model.layers...`,
        `language_model.lm_head.weight`, `vision_tower.vision_model...`); transformers 5 also
        saves the vision tower without `vision_model.`. Decoder names go through the decoder's
        own mapping (fused qkv and gate/up shards)."""
        name = name.removeprefix("model.")
        decoder = self.decoder_name(name)
        if decoder is not None:
            return decoder
        if name.startswith("vision_tower."):
            return "vision_tower." + name.removeprefix("vision_tower.").removeprefix(
                "vision_model."), 0
        return name, 0
