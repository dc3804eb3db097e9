"""The served models as the ingress sees them: name resolution (incl. `vendor/model[/deployment]`),
the tokenizer of each, and the replica handle requests fan out to."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from replicas.model_files import resolve_model_path
from serve_app import generation_defaults, reasoning_formats, tool_formats
from serve_app.config import ModelConfig
from serve_app.errors import APIError
from serve_app.generation_defaults import SamplingDefaults
from serve_app.multimodal import MediaProcessor

logger = logging.getLogger(__name__)


@dataclass
class ServedModel:
    config: ModelConfig
    handle: Any  # DeploymentHandle of the model's LLMReplica deployment
    tokenizer: Any  # transformers tokenizer: chat template, encode
    fast: Tokenizer  # the raw `tokenizers` object: incremental decoding
    # the model's sampling defaults for fields a request omits (--generation-config)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    created: int = field(default_factory=lambda: int(time.time()))
    info: dict[str, Any] | None = None  # from the replica: max_model_len, vocab_size
    media: MediaProcessor | None = None  # a multimodal model's processor

    @property
    def modalities(self) -> frozenset[str]:
        """What the model takes besides text."""
        return self.media.modalities if self.media is not None else frozenset()

    @property
    def name(self) -> str:
        return self.config.name

    @functools.cached_property
    def has_think_tokens(self) -> bool:
        # get_vocab() builds the whole dict: once per model, not once per request
        vocab = self.tokenizer.get_vocab()
        return "<think>" in vocab and "</think>" in vocab

    @functools.cached_property
    def tool_format(self) -> tool_formats.ToolFormat:
        name = self.config.tool_call_parser
        if name is not None:
            return tool_formats.FORMATS[name]
        return tool_formats.detect(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def reasoning_format(self) -> reasoning_formats.ReasoningFormat | None:
        name = self.config.reasoning_parser
        if name == "none":
            return None
        if name is not None:
            return reasoning_formats.FORMATS[name]
        return reasoning_formats.detect(getattr(self.tokenizer, "chat_template", None),
                                        self.has_think_tokens)

    async def ensure_info(self) -> dict[str, Any]:
        if self.info is None:
            self.info = await self.handle.info.remote()
        return self.info


def load_model(config: ModelConfig, handle: Any) -> ServedModel:
    path = resolve_model_path(config.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(path)
    defaults = generation_defaults.load(config.generation_config, path)
    logger.info("%s: sampling defaults %s (--generation-config %s)", config.name,
                defaults.items() or "OpenAI's", config.generation_config)
    media = MediaProcessor.load(path)
    if media is not None:
        logger.info("%s: takes %s", config.name, ", ".join(
            f"{m} (placeholder {token})" for m, (token, _) in media.tokens.items()))
    return ServedModel(config, handle, tokenizer, tokenizer.backend_tokenizer, defaults,
                       media=media)


class ModelRegistry:
    def __init__(self, models: list[ServedModel]) -> None:
        self.models = {m.name: m for m in models}
        self.default = models[0]

    def resolve(self, name: str | None) -> ServedModel:
        """Exact name; else `vendor/model` or `vendor/model/deployment` whose model part names
        a served model (or its last path component)."""
        if name is None or name == "":
            return self.default
        if name in self.models:
            return self.models[name]
        parts = name.split("/")
        candidates = ["/".join(parts[i:j]) for i in range(len(parts))
                      for j in range(len(parts), i, -1)]
        for cand in candidates:
            if cand in self.models:
                return self.models[cand]
        by_tail = {m.split("/")[-1]: m for m in self.models}
        for cand in candidates:
            if cand in by_tail:
                return self.models[by_tail[cand]]
        raise APIError(f"The model `{name}` does not exist.", 404, "model", "NotFoundError")
