"""Media content parts of chat messages -> the prompt's placeholder tokens and the encoder's inputs.

Owns which content parts carry media and their parameter paths (`messages[1].content[2].image_url`,
the name every 400 about the part carries), the per-prompt limits (`--limit-mm-per-prompt`), the
model's processor (transformers' `AutoProcessor` of the model folder: its image processor makes
pixel values, its audio feature extractor log-mel features, and it says how many placeholder
tokens each item takes), expanding each item's one placeholder token of the rendered prompt into
that many (vLLM's prompt update), and each item's content key: BLAKE2b over exactly what the
encoder reads (so processor settings count), the identity the encoder cache and the prefix cache
share.

The ingress does the decoding and preprocessing (on its preprocessing threads); the replica gets
pixel arrays and runs the encoder."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replicas.request import MRopePositions, MultiModalItem
from serve_app.errors import APIError
from serve_app import video_patches
from serve_app.media import FrameSampling, MediaFetcher, decode_audio, decode_image, decode_video
from serve_app.protocol import ContentPart

logger = logging.getLogger(__name__)

# content part type -> (modality, the part's field that holds it)
MEDIA_PARTS: dict[str, tuple[str, str]] = {
    "image_url": ("image", "image_url"), "input_image": ("image", "image_url"),
    "image": ("image", "image"), "input_audio": ("audio", "input_audio"),
    "audio_url": ("audio", "audio_url"), "audio": ("audio", "audio"),
    "video_url": ("video", "video_url"), "video": ("video", "video"),
    "image_embeds": ("image", "image_embeds"), "audio_embeds": ("audio", "audio_embeds"),
    "file": ("file", "file"),
}
DETAILS = ("auto", "low", "high")
DEFAULT_LIMIT = 8  # items of a modality per prompt where --limit-mm-per-prompt does not say
AUDIO_FORMATS = ("wav", "mp3")  # OpenAI's; any format libsndfile reads decodes the same way
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
MROPE_MODELS = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request, found while its messages were flattened for the template."""

    modality: str
    url: str
    param: str  # the part's path, for errors
    detail: str | None = None
    # image_embeds / audio_embeds: the part's value (base64 tensors) instead of a URL
    embeds: str | dict[str, Any] | None = None


def media_ref(part: ContentPart, param: str, modalities: frozenset[str]) -> MediaRef:
    """The media a content part names, or a 400 naming the part."""
    modality, field = MEDIA_PARTS[part.type]
    extra = part.model_extra or {}
    value = extra.get(field)
    where = f"{param}.{field}"
    if part.type in ("image_embeds", "audio_embeds"):
        if modality not in modalities:
            takes = " and ".join(sorted(modalities)) or "text only"
            raise APIError(f"this model takes no {modality} input (it takes {takes})",
                           param=param)
        if not isinstance(value, (str, dict)) or not value:
            raise APIError(f"{field} must be a base64 torch.save'd tensor, or an object of "
                           "them", param=where)
        return MediaRef(modality, "", where, embeds=value)
    if modality == "file":
        data = value.get("file_data") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data.startswith(("data:image/", "data:audio/")):
            raise APIError("file parts are served when file_data is a data:image/... or "
                           "data:audio/... URL (file_id needs a files API, which this server "
                           "has not)", param=where)
        modality, value = data[5:10], {"url": data}
    if part.type == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise APIError("input_audio needs {\"data\": <base64>, \"format\": \"wav\" or "
                           "\"mp3\"}", param=where)
        if value.get("format") not in AUDIO_FORMATS:
            raise APIError(f"input_audio format must be one of {', '.join(AUDIO_FORMATS)}",
                           param=f"{where}.format")
        value = {"url": f"data:audio/{value['format']};base64,{value['data']}"}
    if modality not in modalities:
        takes = " and ".join(sorted(modalities)) or "text only"
        raise APIError(f"this model takes no {modality} input (it takes {takes})", param=param)
    if "uuid" in extra and extra["uuid"] is not None:
        raise APIError("uuid is not supported: media items are identified by their content",
                       param=f"{param}.uuid")
    detail = None
    if isinstance(value, dict):
        detail = value.get("detail")
        if detail is not None and detail not in DETAILS:
            raise APIError(f"detail must be one of {', '.join(DETAILS)}", param=f"{where}.detail")
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise APIError(f"the part needs {field} as a URL string or {{\"url\": ...}}", param=where)
    return MediaRef(modality, value, where, detail)


def check_embeds(refs: list[MediaRef], enabled: bool) -> None:
    """Embedding parts only where the server allows them (vLLM's --enable-mm-embeds): they skip
    the encoder, so what they hold is the client's word."""
    for ref in refs:
        if ref.embeds is not None and not enabled:
            raise APIError(f"{ref.param.rsplit('.', 1)[-1]} parts are refused: this server "
                           "computes embeddings with the model's own encoder unless started "
                           "with --enable-mm-embeds", param=ref.param)


def load_embeds(ref: MediaRef, hidden: int, max_bytes: int) -> dict[str, np.ndarray]:
    """An embeddings part -> its rows [n, hidden] float32 (and, as a dict part, the other
    tensors it names, e.g. a Qwen2.5-VL image's image_grid_thw), loaded with torch.load's
    weights_only unpickler (tensors only; blocking: a preprocessing thread)."""
    import torch

    field = ref.param.rsplit(".", 1)[-1]
    parts = ref.embeds if isinstance(ref.embeds, dict) else {field: ref.embeds}
    out: dict[str, np.ndarray] = {}
    for name, text in parts.items():
        where = f"{ref.param}.{name}" if isinstance(ref.embeds, dict) else ref.param
        if not isinstance(text, str) or len(text) * 3 // 4 > max_bytes:
            raise APIError(f"{name} must be a base64 string of at most {max_bytes} bytes",
                           param=where)
        try:
            tensor = torch.load(io.BytesIO(base64.b64decode(text, validate=True)),
                                weights_only=True, map_location="cpu")
        except (binascii.Error, ValueError, RuntimeError, EOFError, OSError,
                pickle.UnpicklingError) as exc:
            raise APIError(f"cannot load {name} as a torch.save'd tensor: "
                           f"{type(exc).__name__}", param=where) from None
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise APIError(f"{name} must hold one dense tensor", param=where)
        out[name] = tensor.numpy(force=True)
    rows = out.pop(field, None)
    if rows is None:
        raise APIError(f"the object needs the embeddings under {field!r}", param=ref.param)
    if rows.ndim == 3 and rows.shape[0] == 1:  # one item saved with its batch axis
        rows = rows[0]
    if rows.ndim != 2 or rows.shape[1] != hidden or not rows.shape[0]:
        raise APIError(f"{field} must be [tokens, {hidden}] (this model's hidden size), got "
                       f"{list(rows.shape)}", param=ref.param)
    if not np.issubdtype(rows.dtype, np.floating) or not np.isfinite(rows).all():
        raise APIError(f"{field} must hold finite floats", param=ref.param)
    return {"embeds": np.ascontiguousarray(rows, dtype=np.float32), **out}


def check_limits(refs: list[MediaRef], limits: dict[str, int]) -> None:
    seen: dict[str, int] = {}
    for ref in refs:
        seen[ref.modality] = seen.get(ref.modality, 0) + 1
        limit = limits.get(ref.modality, DEFAULT_LIMIT)
        if seen[ref.modality] > limit:
            raise APIError(f"at most {limit} {ref.modality} item(s) per prompt "
                           "(--limit-mm-per-prompt)", param=ref.param)


class MediaProcessor:
    """A multimodal model's processor as the ingress uses it: per modality, the placeholder
    token and the encoder inputs and placeholder count of each item."""

    def __init__(self, hf_config: Any, processor: Any = None, image_processor: Any = None,
                 image_token: tuple[str, int] | None = None,
                 token_names: dict[int, str] | None = None) -> None:
        """`processor`: the folder's AutoProcessor; or, where transformers cannot build one here
        (Qwen2-VL's builds a video processor, which needs torchvision), `image_processor` and
        `image_token` (placeholder, id) alone."""
        self.processor = processor
        self.token_names = token_names or {}
        self.image_processor = getattr(processor, "image_processor", image_processor)
        self.feature_extractor = getattr(processor, "feature_extractor", None)
        self.tokens: dict[str, tuple[str, int]] = {}  # modality -> (placeholder, its id)
        if self.image_processor is not None:
            self.tokens["image"] = image_token or (processor.image_token,
                                                   int(processor.image_token_id))
        vision = getattr(hf_config, "vision_config", None)
        self.uses_mrope = hf_config.model_type in MROPE_MODELS
        self.tokens_per_second = 1.0
        if self.uses_mrope and getattr(hf_config, "video_token_id", None) is not None:
            # the Qwen2-VL family: a video is frames through the image processor, paired into
            # temporal patches (serve_app/video_patches.py)
            video_id = int(hf_config.video_token_id)
            self.tokens["video"] = (self.image_processor_token(video_id), video_id)
            self.tokens_per_second = float(getattr(vision, "tokens_per_second", 1))
            self.frame_sampling = FrameSampling(
                multiple=int(self.image_processor.temporal_patch_size))
        if self.feature_extractor is not None:
            self.tokens["audio"] = (processor.audio_token, int(processor.audio_token_id))
            self.sampling_rate = int(self.feature_extractor.sampling_rate)
            # the extractor pads (and would cut) every clip to one window: longer is refused
            self.max_audio_s = float(self.feature_extractor.chunk_length)
        self.modalities = frozenset(self.tokens)
        size = getattr(vision, "image_size", None)
        self.image_size: int | None = int(size) if size else None
        # M-RoPE models (the Qwen2-VL family) get the prompt's 3-D positions from here
        self.spatial_merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
        text = hf_config.get_text_config(decoder=True)
        self.hidden_size = int(text.hidden_size)  # what embeddings parts must match
        self.settings = {m: set(self._part(m).to_dict()) for m in self.tokens}

    def image_processor_token(self, token_id: int) -> str:
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None:
            return tokenizer.convert_ids_to_tokens(token_id)
        return self.token_names.get(token_id, str(token_id))

    def _part(self, modality: str) -> Any:
        return self.feature_extractor if modality == "audio" else self.image_processor

    @classmethod
    def load(cls, path: Path) -> MediaProcessor | None:
        """The model folder's processor when the model takes media, else None."""
        if not any((path / name).exists() for name in PROCESSOR_FILES):
            return None
        config = json.loads((path / "config.json").read_text())
        if "vision_config" not in config and "audio_config" not in config:
            return None
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

        hf_config = AutoConfig.from_pretrained(path)
        try:
            return cls(hf_config, AutoProcessor.from_pretrained(path))
        except ImportError:
            # transformers' Qwen2-VL-family processors also build a video processor, which
            # needs torchvision; images need only the image processor and the token
            tokenizer = AutoTokenizer.from_pretrained(path)
            ids = [int(hf_config.image_token_id)]
            if getattr(hf_config, "video_token_id", None) is not None:
                ids.append(int(hf_config.video_token_id))
            names = {i: tokenizer.convert_ids_to_tokens(i) for i in ids}
            return cls(hf_config, image_processor=AutoImageProcessor.from_pretrained(path),
                       image_token=(names[ids[0]], ids[0]), token_names=names)

    def decode(self, blob: bytes, ref: MediaRef, max_pixels: int) -> Any:
        """An item's bytes -> what its processor takes (blocking: a preprocessing thread)."""
        if ref.modality == "audio":
            return decode_audio(blob, ref.param, self.sampling_rate, self.max_audio_s)
        if ref.modality == "video":
            return decode_video(blob, ref.param, self.frame_sampling, max_pixels)
        return decode_image(blob, ref.param, max_pixels, ref.detail)

    def _settings(self, modality: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's mm_processor_kwargs that this modality's processor has."""
        known = set().union(*self.settings.values())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise APIError(f"mm_processor_kwargs: {unknown[0]!r} is not a setting of this "
                           f"model's processor (it has {', '.join(sorted(known))})",
                           param="mm_processor_kwargs")
        return {k: v for k, v in kwargs.items() if k in self.settings[modality]}

    def _encoder_inputs(self, modality: str, items: list[Any],
                        settings: dict[str, Any]) -> list[tuple[dict[str, np.ndarray], int]]:
        """(encoder inputs, placeholder tokens) of each item of one modality."""
        if modality == "audio":
            inputs, _ = self.processor._process_audio(
                items, sampling_rate=self.sampling_rate, return_tensors="np", **settings)
            return [({"input_features": np.ascontiguousarray(f, dtype=np.float32),
                      "feature_attention_mask": np.ascontiguousarray(m, dtype=np.int32)},
                     int(n))
                    for f, m, n in zip(inputs["input_features"],
                                       inputs["feature_attention_mask"],
                                       inputs["num_audio_tokens"], strict=True)]
        if modality == "video":
            return [self._video_inputs(frames, settings) for frames in items]
        out = self.image_processor(items, return_tensors="np", **settings)
        pixels = out["pixel_values"]
        if "image_grid_thw" in out:
            # dynamic resolution (Qwen2-VL family): each image its own grid of patch rows,
            # merged spatial_merge^2 to one token
            grids = [np.asarray(g, dtype=np.int64) for g in out["image_grid_thw"]]
            rows = np.split(pixels, np.cumsum([int(np.prod(g)) for g in grids])[:-1])
            return [({"pixel_values": np.ascontiguousarray(r, dtype=np.float32),
                      "image_grid_thw": g}, int(np.prod(g)) // self.spatial_merge ** 2)
                    for r, g in zip(rows, grids, strict=True)]
        counts = self.processor._get_num_multimodal_tokens(
            image_sizes=[(im.height, im.width) for im in items],
            images_kwargs=settings).num_image_tokens
        if self.image_size is not None and pixels.shape[-2:] != (self.image_size,) * 2:
            raise APIError(f"mm_processor_kwargs make {pixels.shape[-2]} x {pixels.shape[-1]} "
                           f"pixel images; this model's vision encoder takes {self.image_size}"
                           f" x {self.image_size}", param="mm_processor_kwargs")
        return [({"pixel_values": np.ascontiguousarray(p, dtype=np.float32)}, int(n))
                for p, n in zip(pixels, counts, strict=True)]

    def _video_inputs(self, frames: list[Any],
                      settings: dict[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """One video's sampled frames -> its temporal patches, as Qwen2-VL's video processor
        makes them: every frame resized and normalised by the image processor (so a frame
        looks exactly as the same picture sent as an image), frames paired into temporal
        patches (the last repeated to fill the final one)."""
        ip = self.image_processor
        out = ip(frames, return_tensors="np", **settings)
        patch, merge, temporal = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        grid = out["image_grid_thw"][0]
        if any((g != grid).any() for g in out["image_grid_thw"]):
            raise APIError("the video's frames differ in size", param="messages")
        video = video_patches.unpatchify(out["pixel_values"], len(frames), grid, patch, merge,
                                          temporal)
        pixels, grid_thw = video_patches.patchify(video, patch, merge, temporal)
        second_per_grid = temporal / self.frame_sampling.fps
        return ({"pixel_values": pixels, "video_grid_thw": grid_thw,
                 "second_per_grid": np.array(second_per_grid)},
                int(np.prod(grid_thw)) // self.spatial_merge ** 2)

    def _embeds_input(self, modality: str, data: dict[str, np.ndarray],
                      ref: MediaRef) -> tuple[dict[str, np.ndarray], int]:
        """An embeddings part's rows stand in for the encoder's: as many placeholders as rows
        (an M-RoPE model's image also needs its image_grid_thw, which fixes that count)."""
        grid_name = f"{modality}_grid_thw"
        if self.uses_mrope and modality != "audio":
            grid = data.get(grid_name)
            if grid is None or grid.size != 3:
                raise APIError(f"this model's {modality} embeddings need {grid_name} beside "
                               f"them ({{\"{modality}_embeds\": ..., \"{grid_name}\": ...}})",
                               param=ref.param)
            grid = np.asarray(grid, dtype=np.int64).reshape(3)
            if int(np.prod(grid)) != len(data["embeds"]) * self.spatial_merge ** 2:
                raise APIError(f"{grid_name} {grid.tolist()} makes "
                               f"{int(np.prod(grid)) // self.spatial_merge ** 2} rows, the "
                               f"embeddings have {len(data['embeds'])}", param=ref.param)
            data = {**data, grid_name: grid}
            if modality == "video":
                data["second_per_grid"] = np.array(
                    self.image_processor.temporal_patch_size / self.frame_sampling.fps)
        return data, len(data["embeds"])

    def process(self, ids: list[int], media: list[Any], refs: list[MediaRef],
                kwargs: dict[str, Any] | None) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Prompt ids with one placeholder per item -> ids with each expanded, and the items
        (blocking: a preprocessing thread runs it). `media[i]` is `refs[i]`'s decoded item."""
        kwargs = dict(kwargs or {})
        # modality -> the prompt positions of its placeholders, in order
        found = {m: [i for i, t in enumerate(ids) if t == token_id]
                 for m, (_, token_id) in self.tokens.items()}
        for m, (token, _) in self.tokens.items():
            n = sum(r.modality == m for r in refs)
            if len(found[m]) != n:
                raise APIError(f"the prompt holds {len(found[m])} {m} placeholder(s) ({token}) "
                               f"for {n} {m} item(s): text may not carry the placeholder "
                               "itself", param="messages")
        inputs: dict[str, list[tuple[dict[str, np.ndarray], int]]] = {}
        try:
            for m in self.tokens:
                mine = [(x, r) for x, r in zip(media, refs, strict=True) if r.modality == m]
                settings = self._settings(m, kwargs)
                encoded = iter(self._encoder_inputs(
                    m, [x for x, r in mine if r.embeds is None], settings)
                    if any(r.embeds is None for _, r in mine) else [])
                inputs[m] = [self._embeds_input(m, x, r) if r.embeds is not None
                             else next(encoded) for x, r in mine]
        except APIError:
            raise
        except Exception as exc:  # a setting of the wrong type or value
            raise APIError(f"mm_processor_kwargs: {type(exc).__name__}: {exc}",
                           param="mm_processor_kwargs") from None
        placed = sorted((pos, m, k) for m, positions in found.items()
                        for k, pos in enumerate(positions))
        out: list[int] = []
        items = []
        prev = 0
        for pos, m, k in placed:
            out.extend(ids[prev:pos])
            data, count = inputs[m][k]
            items.append(MultiModalItem(m, len(out), count, content_key(m, data), data))
            out.extend([ids[pos]] * count)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, tuple(items)


def mrope_positions(num_tokens: int, items: tuple[MultiModalItem, ...], spatial_merge: int,
                    tokens_per_second: float = 1.0) -> MRopePositions:
    """M-RoPE positions of a prompt, as transformers' Qwen2.5-VL `get_rope_index` makes them:
    text tokens count up on all three axes; an image's tokens take (start, start + row,
    start + column) over its merged grid (a video's temporal patches start + k x
    tokens_per_second x seconds per patch on the first axis), and the text after it starts at
    start + the grid's longer side."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current = prev = 0
    for item in items:
        positions[:, prev:item.offset] = np.arange(current, current + item.offset - prev)
        current += item.offset - prev
        t, h, w = (int(v) for v in item.data[f"{item.modality}_grid_thw"])
        interval = (tokens_per_second * float(item.data["second_per_grid"])
                    if item.modality == "video" else 1.0)
        grid = np.meshgrid((np.arange(t) * interval).astype(np.int64),
                           np.arange(h // spatial_merge), np.arange(w // spatial_merge),
                           indexing="ij")
        end = item.offset + item.length
        positions[:, item.offset:end] = np.stack([g.ravel() for g in grid]) + current
        current += max(h, w) // spatial_merge
        prev = end
    positions[:, prev:] = np.arange(current, current + num_tokens - prev)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return MRopePositions(positions, delta)


def content_key(modality: str, data: dict[str, np.ndarray]) -> bytes:
    """BLAKE2b-256 over exactly what the encoder reads: every input's name, shape, dtype, bytes."""
    h = hashlib.blake2b(digest_size=32, person=b"shardserve-mm")
    h.update(modality.encode())
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        h.update(repr((name, array.shape, str(array.dtype))).encode())
        h.update(memoryview(array).cast("B"))
    return h.digest()


async def load_media(fetcher: MediaFetcher, media: MediaProcessor, refs: list[MediaRef],
                     max_pixels: int, run: Any) -> list[Any]:
    """Fetches every item at once, decodes each (or loads an embeddings part) on a
    preprocessing thread (`run`)."""
    import asyncio

    async def one(ref: MediaRef) -> Any:
        if ref.embeds is not None:
            return await run(load_embeds, ref, media.hidden_size, fetcher.policy.max_bytes)
        return await run(media.decode, await fetcher.load(ref.url, ref.param), ref, max_pixels)
    return list(await asyncio.gather(*(one(r) for r in refs)))


def truncate_items(ids: list[int], kept: list[int],
                   items: tuple[MultiModalItem, ...]) -> tuple[MultiModalItem, ...]:
    """The items of a prompt truncated to its last `len(kept)` tokens, their offsets moved; a
    400 where the cut falls inside or before an item (its tokens would have no image)."""
    cut = len(ids) - len(kept)
    if cut == 0 or not items:
        return items
    if items[0].offset < cut:
        raise APIError("truncate_prompt_tokens would cut an image out of the prompt",
                       param="truncate_prompt_tokens")
    return tuple(MultiModalItem(i.modality, i.offset - cut, i.length, i.key, i.data)
                 for i in items)
