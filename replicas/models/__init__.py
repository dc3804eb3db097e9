"""Model code on tensor-parallel layers and the paged KV cache. `get_model_class` picks it by the
HF config's architecture."""

from __future__ import annotations

from transformers import PretrainedConfig

from replicas.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(config: PretrainedConfig) -> type:
    for arch in config.architectures or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(
        f"architecture {config.architectures} is not supported; supported: {sorted(_ARCHITECTURES)}")
