"""Model code on tensor-parallel layers and the paged KV cache. `get_model_class` picks it by the
HF config's architecture; `text_config` is the config of the part that owns the KV cache (the
decoder of a multimodal model). A model class's `modalities` says which media its `encode` takes
(empty for text-only models); its `uses_mrope` says whether `forward` takes [3, T] positions
(M-RoPE: temporal, height, width) instead of [T]."""

from __future__ import annotations

from transformers import PretrainedConfig

from replicas.models.llama import LlamaForCausalLM
from replicas.models.llava import LlavaForConditionalGeneration
from replicas.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from replicas.models.qwen2_audio import Qwen2AudioForConditionalGeneration

_ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2AudioForConditionalGeneration": Qwen2AudioForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


def get_model_class(config: PretrainedConfig) -> type:
    for arch in config.architectures or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(
        f"architecture {config.architectures} is not supported; supported: {sorted(_ARCHITECTURES)}")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (layers, heads, vocabulary, context length, eos): a multimodal
    checkpoint's `text_config`, a text model's config itself."""
    return config.get_text_config(decoder=True)
