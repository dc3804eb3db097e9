"""Qwen2-Audio (HF `model_type` "qwen2_audio"): a Whisper-style audio encoder and a one-linear
projector in front of our Qwen2 decoder.

Owns the audio side: `encode` turns audios (the processor's log-mel `input_features` [mel bins,
3000 frames] and `feature_attention_mask` [3000], one audio each) into rows of the decoder's
embedding space, exactly the rows transformers' model puts at that audio's `<|AUDIO|>` tokens:
`audio_tokens(L)` of them for L = the mask's sum. transformers runs all 1500 positions of the
window, attends only to the first `(L - 1) // 2 + 1` of them (the rest is padding) and keeps
`audio_tokens(L)` pooled rows, which read only those; here the encoder stops at the longest
audio's attended positions (the convolutions still read the padding frames next to them, as
there), which gives the same rows for a fraction of the work on short audios. The runner hands
the rows back to `forward` as `embeds`, which replace the embeddings of the placeholder tokens.
The decoder is `LlamaForCausalLM` built from `config.text_config`; the encoder and the projector
are plain torch layers, replicated on every tensor-parallel rank, never packed nor quantized.

`audio_token_id(config)` and `audio_tokens(frames)` say which token stands for an audio and how
many of them it takes, for the side that builds prompts without the model."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from replicas.models.llama import LlamaForCausalLM
from replicas.models.multimodal import MultimodalModel
from replicas.models.llava import _DECODERS, _activation


def audio_tokens(frames: int) -> int:
    """Placeholder tokens (= encoder rows) of an audio whose feature mask holds `frames` ones:
    Qwen2AudioProcessor's formula (conv2 halves the frames, the pooler halves them again)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


def audio_token_id(config: PretrainedConfig) -> int:
    """The token that stands for one row of an audio in the prompt."""
    return int(config.audio_token_index)


class AudioAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.scale = (d // self.num_heads) ** -0.5
        self.k_proj = nn.Linear(d, d, bias=False)  # Whisper's keys have no bias
        self.v_proj = nn.Linear(d, d)
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        # queries scaled before the product, as Whisper does (the same rounding in half precision)
        q = (self.q_proj(x) * self.scale).view(b, t, self.num_heads, -1).transpose(1, 2)
        k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2)
                for p in (self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = AudioAttention(config)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _activation(config.activation_function)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Qwen2-Audio's Whisper encoder (names as in HF checkpoints): two convolutions (the second
    halves the frames), learned positions, pre-norm layers, then average pooling by two and a
    layernorm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        d = config.d_model
        self.frames = 2 * config.max_source_positions  # what the feature extractor pads to
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(config)
                                    for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """features [b, mel bins, frames]; lengths: each audio's positions after conv2 that
        the layers attend to. Returns [b, max(lengths) // 2, d]: row j of an audio pools its
        positions 2j and 2j + 1, so its first lengths[i] // 2 rows read only its own."""
        n = max(max(lengths), 1)
        # conv2's first n outputs read frames up to 2n: later frames change no kept row
        x = F.gelu(self.conv1(features[..., :2 * n + 1]))
        x = F.gelu(self.conv2(x))[..., :n].transpose(1, 2)
        x = x + self.embed_positions.weight[:n]
        mask = None
        if min(lengths) < n:  # keys past an audio's length are padding, as transformers masks
            keys = torch.arange(n, device=x.device)[None, :] < torch.tensor(
                lengths, device=x.device)[:, None]
            mask = keys[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.audio_config.d_model, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(MultimodalModel):
    modalities: frozenset[str] = frozenset({"audio"})

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.text_config.model_type not in _DECODERS:
            raise ValueError(f"Qwen2-Audio decoder {config.text_config.model_type!r} is not "
                             f"supported; supported: {list(_DECODERS)}")
        self.config = config
        self.audio_tower = AudioEncoder(config.audio_config)
        self.multi_modal_projector = Projector(config)
        self.language_model = LlamaForCausalLM(config.text_config)
        # transformers declares no tied weights for Qwen2-Audio: its head is its own tensor
        # (saved and loaded apart from the embeddings) whatever text_config says
        self.tie_word_embeddings = False

    @torch.no_grad()
    def encode(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each item's embedding rows [audio_tokens(mask sum), text hidden] in the decoder's
        dtype; all items run through the encoder as one batch, padded to the longest."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio encodes audio, not {modality!r}")
        tower = self.audio_tower
        shape = (tower.conv1.in_channels, tower.frames)
        frames = []
        for item in items:
            features, mask = item["input_features"], item["feature_attention_mask"]
            if features.shape != shape or mask.shape != shape[1:]:
                raise ValueError(f"audio features must be {shape} with a mask of {shape[1]} "
                                 f"frames (the feature extractor's padding), got "
                                 f"{features.shape} and {mask.shape}")
            frames.append(int(mask.sum()))
        weight = self.multi_modal_projector.linear.weight
        features = torch.from_numpy(np.stack([item["input_features"] for item in items]))
        rows = self.multi_modal_projector(tower(features.to(weight.device, weight.dtype),
                                                [(f - 1) // 2 + 1 for f in frames]))
        return [r[:audio_tokens(f)] for r, f in zip(rows, frames)]

    def checkpoint_name(self, name: str) -> tuple[str, int]:
        """Maps an HF checkpoint tensor name to (our parameter name, shard index), in both
        layouts: transformers >= 4.52 loaded (`model.language_model.layers...`, `lm_head.weight`,
        `model.audio_tower...`, `model.multi_modal_projector...`) and the older one, which
        Qwen2-Audio-7B ships and transformers 5 still saves (`language_model.model.layers...`,
        `language_model.lm_head.weight`, `audio_tower...`, `multi_modal_projector...`). Decoder
        names go through the decoder's own mapping (fused qkv and gate/up shards)."""
        name = name.removeprefix("model.")
        decoder = self.decoder_name(name)
        if decoder is not None:
            return decoder
        return name, 0
