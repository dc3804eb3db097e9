"""What every multimodal model here shares: an encoder in front of our Llama-family decoder.

`MultimodalModel` owns the decoder side the runner and the worker see: `layers` (the decoder's,
which size the KV cache), `forward` (the decoder's, with `embeds`: the encoder rows that replace
the placeholder tokens' embeddings) and `compute_logits`. A subclass builds `language_model` and
its encoder, and implements `encode(modality, items)` and `checkpoint_name`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from replicas.attention import AttentionMetadata
from replicas.models.llama import LlamaForCausalLM


class MultimodalModel(nn.Module):
    modalities: frozenset[str] = frozenset()
    uses_mrope = False  # positions are [3, T] (the Qwen2-VL family) instead of [T]
    language_model: LlamaForCausalLM

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder's layers (the worker sizes the KV cache from their attention)."""
        return self.language_model.layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The decoder's forward; `embeds` (flat token index, rows from `encode`) replace the
        embeddings of the media placeholder tokens among this step's tokens."""
        return self.language_model(input_ids, positions, kv_cache, meta, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def decoder_name(self, name: str) -> tuple[str, int] | None:
        """(our parameter, shard) of a decoder tensor named as in a checkpoint whose decoder
        sits under `language_model.` (its head under `lm_head.` or
        `language_model.lm_head.`), through the decoder's own mapping; None for other names."""
        if name.startswith("lm_head."):
            name = "language_model." + name
        if not name.startswith("language_model."):
            return None
        target, shard = self.language_model.checkpoint_name(name.removeprefix("language_model."))
        return "language_model." + target, shard

    def encode(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each item's embedding rows [placeholder tokens, decoder hidden], in the decoder's
        dtype."""
        raise NotImplementedError
