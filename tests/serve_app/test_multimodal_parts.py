"""Media parts -> template parts and sources; a rendered prompt's placeholders -> expanded tokens and
items with content keys (serve_app/multimodal.py, no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from replicas.embedded import TINY_LLAVA_MODEL_ID, EMBEDDED_MODELS
from replicas.request import MultiModalItem
from serve_app import chat
from serve_app.errors import APIError
from serve_app.multimodal import MediaProcessor, MediaRef, check_limits, truncate_items
from serve_app.protocol import Message


@pytest.fixture(scope="module")
def media() -> MediaProcessor:
    processor = MediaProcessor.load(EMBEDDED_MODELS[TINY_LLAVA_MODEL_ID]())
    assert processor is not None
    return processor


def test_parts_become_template_parts_and_sources_in_order() -> None:
    messages = [Message(role="user", content=[
        {"type": "text", "text": "a"}, {"image_url": "https://example.com/1.png"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}}]),
        Message(role="assistant", content="b")]
    refs: list[MediaRef] = []
    out = chat.to_template_messages(messages, frozenset({"image"}), refs)
    assert out[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"},
                                 {"type": "image"}]
    assert out[1]["content"] == "b"
    assert [(r.url, r.param, r.detail) for r in refs] == [
        ("https://example.com/1.png", "messages[0].content[1].image_url", None),
        ("data:image/png;base64,AA", "messages[0].content[2].image_url", "low")]
    with pytest.raises(APIError, match="text-only") as info:  # a text-only model
        chat.to_template_messages(messages)
    assert info.value.param == "messages[0].content[1].type"


def test_limits_name_the_first_part_over() -> None:
    refs = [MediaRef("image", "u", f"messages[0].content[{i}].image_url") for i in range(3)]
    check_limits(refs[:2], {"image": 2})
    with pytest.raises(APIError, match="at most 2") as info:
        check_limits(refs, {"image": 2})
    assert info.value.param == "messages[0].content[2].image_url"


def test_placeholders_expand_to_the_processors_count(media: MediaProcessor) -> None:
    t = media.tokens["image"][1]
    red, blue = Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (90, 70), (0, 0, 255))
    refs = [MediaRef("image", "u", "p")] * 2
    ids, items = media.process([1, t, 2, 3, t, 4], [red, blue], refs, None)
    assert ids == [1] + [t] * 16 + [2, 3] + [t] * 16 + [4]
    assert [(i.offset, i.length) for i in items] == [(1, 16), (19, 16)]
    assert items[0].data["pixel_values"].shape == (3, 56, 56)
    assert items[0].key != items[1].key and len(items[0].key) == 32
    _, again = media.process([t], [red.copy()], refs[:1], None)
    assert again[0].key == items[0].key  # the content, not the object, is the identity
    with pytest.raises(APIError, match="placeholder"):
        media.process([1, t, t], [red], refs[:1], None)
    with pytest.raises(APIError) as info:
        media.process([t], [red], refs[:1], {"no_such_setting": 1})
    assert info.value.param == "mm_processor_kwargs"
    kept = ids[5:]
    with pytest.raises(APIError, match="cut an image"):
        truncate_items(ids, kept, items)
    moved = truncate_items(ids, ids[1:], items)
    assert [i.offset for i in moved] == [0, 18]
    assert np.array_equal(moved[1].data["pixel_values"], items[1].data["pixel_values"])


def test_audio_parts() -> None:
    messages = [Message(role="user", content=[
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "https://example.com/a.mp3"}},
        {"audio_url": "https://example.com/b.mp3"},
        {"type": "file", "file": {"file_data": "data:audio/wav;base64,UklGRg=="}}])]
    refs: list[MediaRef] = []
    out = chat.to_template_messages(messages, frozenset({"audio"}), refs)
    assert out[0]["content"] == [{"type": "audio"}] * 4
    assert [(r.modality, r.url) for r in refs] == [
        ("audio", "data:audio/wav;base64,UklGRg=="), ("audio", "https://example.com/a.mp3"),
        ("audio", "https://example.com/b.mp3"), ("audio", "data:audio/wav;base64,UklGRg==")]
    for part, param in (
            ({"type": "input_audio", "input_audio": {"data": "AA", "format": "ogg"}},
             "messages[0].content[0].input_audio.format"),
            ({"type": "input_audio", "input_audio": "AA"}, "messages[0].content[0].input_audio"),
            ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
             "messages[0].content[0]")):
        with pytest.raises(APIError) as info:
            chat.to_template_messages([Message(role="user", content=[part])],
                                      frozenset({"audio"}), [])
        assert info.value.param == param


def test_mrope_positions_are_transformers_and_continue_past_the_prompt() -> None:
    """The ingress's 3-D positions equal transformers' Qwen2.5-VL `get_rope_index` on the tiny
    Qwen2.5-VL; the engine continues them past the prompt as p + delta on every axis."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from replicas.embedded import TINY_QWEN2_5_VL_MODEL_ID
    from replicas.engine import _mrope_positions
    from replicas.request import MultiModalItem, SamplingParams, Sequence
    from serve_app.multimodal import mrope_positions

    config = AutoConfig.from_pretrained(EMBEDDED_MODELS[TINY_QWEN2_5_VL_MODEL_ID]())
    merge = config.vision_config.spatial_merge_size
    grids = [np.array([1, 8, 6]), np.array([1, 4, 4])]
    counts = [int(g.prod()) // merge**2 for g in grids]
    pad = config.image_token_id
    ids = [5, 6] + [pad] * counts[0] + [7, 8, 9] + [pad] * counts[1] + [10]
    items = (MultiModalItem("image", 2, counts[0], b"a" * 32, {"image_grid_thw": grids[0]}),
             MultiModalItem("image", 5 + counts[0], counts[1], b"b" * 32,
                            {"image_grid_thw": grids[1]}))
    ours = mrope_positions(len(ids), items, merge)
    with torch.device("meta"):
        reference = Qwen2_5_VLModel(config)
    types = torch.tensor([[int(t == pad) for t in ids]])
    theirs, delta = reference.get_rope_index(torch.tensor([ids]), types,
                                             image_grid_thw=torch.tensor(np.stack(grids)))
    assert np.array_equal(ours.prompt, theirs[:, 0].numpy()) and ours.delta == int(delta)
    seq = Sequence(0, "r", 0, ids + [11, 12], len(ids), SamplingParams(max_tokens=4))
    seq.mrope = ours
    step = _mrope_positions(seq, len(ids) - 1, len(ids) + 2)
    last = ours.prompt[:, -1]
    assert np.array_equal(step[:, 0], last)
    assert np.array_equal(step[:, 1:], np.array([[len(ids) + ours.delta,
                                                  len(ids) + 1 + ours.delta]] * 3))


def test_video_frames_become_temporal_patches_as_an_image_would() -> None:
    """Two identical frames are the image processor's own rows for that picture (an image is
    its frame twice); five frames make three temporal patches, the last frame repeated; the
    video's 3-D positions space its temporal patches as transformers' get_rope_index does."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from replicas.embedded import TINY_QWEN2_5_VL_MODEL_ID
    from serve_app.multimodal import mrope_positions

    folder = EMBEDDED_MODELS[TINY_QWEN2_5_VL_MODEL_ID]()
    media = MediaProcessor.load(folder)
    assert media is not None and media.modalities == {"image", "video"}
    rng = np.random.default_rng(0)
    frame = Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8))
    image = media.image_processor([frame], return_tensors="np")
    (data, count), = [media._video_inputs([frame, frame], {})]
    assert np.array_equal(data["pixel_values"], image["pixel_values"])
    assert data["video_grid_thw"].tolist() == image["image_grid_thw"][0].tolist() == [1, 6, 8]
    assert count == 12
    frames = [Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8))
              for _ in range(5)]
    (five, count), = [media._video_inputs(frames, {})]
    assert five["video_grid_thw"].tolist() == [3, 6, 8] and count == 36
    last = media._video_inputs([frames[4], frames[4]], {})[0]["pixel_values"]
    assert np.array_equal(five["pixel_values"][-48:], last)

    config = AutoConfig.from_pretrained(folder)
    video, pad = config.video_token_id, config.image_token_id
    ids = [5] + [video] * 36 + [6, 7] + [pad] * 12 + [8]
    items = (MultiModalItem("video", 1, 36, b"v" * 32, five),
             MultiModalItem("image", 39, 12, b"i" * 32, {"image_grid_thw": np.array([1, 6, 8])}))
    ours = mrope_positions(len(ids), items, 2, media.tokens_per_second)
    with torch.device("meta"):
        reference = Qwen2_5_VLModel(config)
    types = torch.tensor([[1 if t == pad else 2 if t == video else 0 for t in ids]])
    theirs, delta = reference.get_rope_index(
        torch.tensor([ids]), types, image_grid_thw=torch.tensor([[1, 6, 8]]),
        video_grid_thw=torch.tensor([[3, 6, 8]]),
        second_per_grid_ts=torch.tensor([float(five["second_per_grid"])]))
    assert np.array_equal(ours.prompt, theirs[:, 0].numpy()) and ours.delta == int(delta)


def test_embeddings_parts_need_the_flag_and_the_models_width(media: MediaProcessor) -> None:
    import base64
    import io

    import torch

    from serve_app.multimodal import check_embeds, load_embeds

    def b64(value: object) -> str:
        out = io.BytesIO()
        torch.save(value, out)
        return base64.b64encode(out.getvalue()).decode()
    part = {"type": "image_embeds", "image_embeds": b64(torch.ones(16, 256))}
    refs: list[MediaRef] = []
    chat.to_template_messages([Message(role="user", content=[part])], frozenset({"image"}), refs)
    with pytest.raises(APIError, match="--enable-mm-embeds") as info:
        check_embeds(refs, enabled=False)
    assert info.value.param == "messages[0].content[0].image_embeds"
    check_embeds(refs, enabled=True)
    data = load_embeds(refs[0], 256, 1 << 20)
    assert data["embeds"].shape == (16, 256) and data["embeds"].dtype == np.float32
    t = media.tokens["image"][1]
    ids, items = media.process([1, t, 2], [data], refs, None)
    assert ids == [1] + [t] * 16 + [2] and items[0].length == 16
    for value, words in ((b64(torch.ones(16, 64)), "hidden size"),
                         (b64({"not": "a tensor"}), "one dense tensor"),
                         (b64(torch.full((2, 256), float("nan"))), "finite"),
                         ("bm90IGEgdGVuc29y", "cannot load")):
        with pytest.raises(APIError, match=words):
            load_embeds(MediaRef("image", "", "p.image_embeds", embeds=value), 256, 1 << 20)
