"""Media content parts of chat messages -> the prompt's placeholder tokens and the encoder's inputs.

Owns which content parts carry media and their parameter paths (`messages[1].content[2].image_url`,
the name every 400 about the part carries), the per-prompt limits (`--limit-mm-per-prompt`), the
model's processor (transformers' `AutoProcessor` of the model folder: its image processor makes
the pixel values, and it says how many placeholder tokens each image takes), expanding each
image's one placeholder token of the rendered prompt into that many (vLLM's prompt update), and
each item's content key: BLAKE2b over exactly what the encoder reads (shape and pixel values,
so processor settings count), the identity the encoder cache and the prefix cache share.

The ingress does the decoding and preprocessing (on its preprocessing threads); the replica gets
pixel arrays and runs the encoder."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replicas.request import MultiModalItem
from serve_app.errors import APIError
from serve_app.media import MediaFetcher, decode_image
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
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request, found while its messages were flattened for the template."""

    modality: str
    url: str
    param: str  # the part's path, for errors
    detail: str | None = None


def media_ref(part: ContentPart, param: str, modalities: frozenset[str]) -> MediaRef:
    """The media a content part names, or a 400 naming the part."""
    modality, field = MEDIA_PARTS[part.type]
    extra = part.model_extra or {}
    value = extra.get(field)
    where = f"{param}.{field}"
    if part.type in ("image_embeds", "audio_embeds"):
        raise APIError(f"{part.type} parts are not supported: send the {modality} itself; this "
                       "server computes embeddings with the model's own encoder", param=where)
    if modality == "file":
        data = value.get("file_data") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data.startswith("data:image/"):
            raise APIError("file parts are served when file_data is a data:image/... URL "
                           "(file_id needs a files API, which this server has not)", param=where)
        modality, value = "image", {"url": data}
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


def check_limits(refs: list[MediaRef], limits: dict[str, int]) -> None:
    seen: dict[str, int] = {}
    for ref in refs:
        seen[ref.modality] = seen.get(ref.modality, 0) + 1
        limit = limits.get(ref.modality, 0)
        if seen[ref.modality] > limit:
            raise APIError(f"at most {limit} {ref.modality} item(s) per prompt "
                           "(--limit-mm-per-prompt)", param=ref.param)


class MediaProcessor:
    """A multimodal model's processor as the ingress uses it."""

    def __init__(self, processor: Any, hf_config: Any) -> None:
        self.processor = processor
        self.image_token: str = processor.image_token
        self.image_token_id: int = int(processor.image_token_id)
        self.modalities = frozenset({"image"})
        vision = getattr(hf_config, "vision_config", None)
        size = getattr(vision, "image_size", None)
        self.image_size: int | None = int(size) if size else None
        self.settings = set(processor.image_processor.to_dict())

    @classmethod
    def load(cls, path: Path) -> MediaProcessor | None:
        """The model folder's processor when the model takes images, else None."""
        if not any((path / name).exists() for name in PROCESSOR_FILES):
            return None
        config = json.loads((path / "config.json").read_text())
        if "vision_config" not in config:
            return None
        from transformers import AutoConfig, AutoProcessor

        return cls(AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path))

    def _kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - self.settings)
        if unknown:
            raise APIError(f"mm_processor_kwargs: {unknown[0]!r} is not a setting of this "
                           f"model's image processor (it has {', '.join(sorted(self.settings))})",
                           param="mm_processor_kwargs")
        return kwargs

    def process(self, ids: list[int], images: list[Any], refs: list[MediaRef],
                kwargs: dict[str, Any] | None) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Prompt ids with one placeholder per image -> ids with each expanded, and the items
        (blocking: a preprocessing thread runs it)."""
        found = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(found) != len(images):
            raise APIError(f"the prompt holds {len(found)} image placeholder(s) "
                           f"({self.image_token}) for {len(images)} image(s): text may not "
                           "carry the placeholder itself", param="messages")
        settings = self._kwargs(kwargs)
        if not images:
            return ids, ()
        try:
            pixels = self.processor.image_processor(images, return_tensors="np",
                                                    **settings)["pixel_values"]
            counts = self.processor._get_num_multimodal_tokens(
                image_sizes=[(im.height, im.width) for im in images],
                images_kwargs=settings).num_image_tokens
        except APIError:
            raise
        except Exception as exc:  # a setting of the wrong type or value
            raise APIError(f"mm_processor_kwargs: {type(exc).__name__}: {exc}",
                           param="mm_processor_kwargs") from None
        if self.image_size is not None and pixels.shape[-2:] != (self.image_size,) * 2:
            raise APIError(f"mm_processor_kwargs make {pixels.shape[-2]} x {pixels.shape[-1]} "
                           f"pixel images; this model's vision encoder takes {self.image_size}"
                           f" x {self.image_size}", param="mm_processor_kwargs")
        out: list[int] = []
        items = []
        prev = 0
        for k, (pos, count) in enumerate(zip(found, counts, strict=True)):
            out.extend(ids[prev:pos])
            pv = np.ascontiguousarray(pixels[k], dtype=np.float32)
            items.append(MultiModalItem("image", len(out), int(count), content_key(pv), {
                "pixel_values": pv}))
            out.extend([self.image_token_id] * int(count))
            prev = pos + 1
        out.extend(ids[prev:])
        return out, tuple(items)


def content_key(pixels: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"shardserve-img")
    h.update(repr((pixels.shape, str(pixels.dtype))).encode())
    h.update(memoryview(pixels).cast("B"))
    return h.digest()


async def load_images(fetcher: MediaFetcher, refs: list[MediaRef], max_pixels: int,
                      run: Any) -> list[Any]:
    """Fetches every item at once, decodes each on a preprocessing thread (`run`)."""
    import asyncio

    blobs = await asyncio.gather(*(fetcher.load(r.url, r.param) for r in refs))
    return list(await asyncio.gather(*(run(decode_image, b, r.param, max_pixels, r.detail)
                                       for b, r in zip(blobs, refs, strict=True))))


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
