"""LLaVA in our model code (vision tower, projector, our Llama decoder on the paged cache) gives
transformers' logits on the same weights: `shardserve/tiny-llava`, images through the folder's own
AutoProcessor. Float32 throughout; logits agree within atol 1e-4 + rtol 1e-4 (the text models'
parity bound; the measured gap is ~3e-6 on logits up to ~4.5, from summation order)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

from replicas.embedded import ensure_tiny_llava
from replicas.model_runner import RowInput, StepInput
from replicas.models import get_model_class, text_config
from replicas.models.llava import LlavaForConditionalGeneration, image_placeholder
from replicas.request import MultiModalItem
from replicas.worker import ShardWorker, WorkerConfig
from tests.replicas.mm_steps import (
    BLOCK,
    TOL,
    assert_checkpoint_names,
    assert_same_logits,
    count_encodes,
    gradient,
    resave_renamed,
    slices,
    worker,
)

@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llava(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def processor(folder: Path):
    return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def hf(folder: Path) -> transformers.LlavaForConditionalGeneration:
    return transformers.LlavaForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


RED = gradient((255, 40, 0), (80, 64))
BLUE = gradient((0, 90, 255), (60, 75), vertical=True)
GREEN = gradient((30, 220, 60), (56, 56))


def prompt(processor, text: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    out = processor(text=chat, images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"]


def mm_items(ids: list[int], pixels: torch.Tensor, token_id: int,
             per_image: int) -> list[MultiModalItem]:
    """One item per image: its run of placeholder tokens (in prompt order) and its pixels,
    keyed by a hash of them, as the ingress builds them."""
    starts = [i for i, t in enumerate(ids) if t == token_id][::per_image]
    items = []
    for offset, image in zip(starts, pixels.numpy(), strict=True):
        assert ids[offset:offset + per_image] == [token_id] * per_image
        key = hashlib.blake2b(image.tobytes(), digest_size=32).digest()
        items.append(MultiModalItem("image", offset, per_image, key, {"pixel_values": image}))
    return items


def reference(hf, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]


def test_folder_describes_the_model(folder: Path, processor) -> None:
    config = transformers.AutoConfig.from_pretrained(folder)
    assert get_model_class(config) is LlavaForConditionalGeneration
    assert get_model_class(config).modalities == frozenset({"image"})
    place = image_placeholder(config)
    assert place.token_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    assert place.tokens == 16 and place.image_size == 56
    assert text_config(config).num_hidden_layers == 4
    ids, pixels = prompt(processor, "Two?", [RED, BLUE])
    assert pixels.shape == (2, 3, 56, 56)
    assert ids.count(place.token_id) == 32


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_prefill_and_decode_match_transformers(folder: Path, processor, hf,
                                               attention: str) -> None:
    w = worker(folder, attention)
    calls = count_encodes(w)
    place = image_placeholder(w.runner.model.config)
    # row 0: two images; row 1: one image and a longer text; prefilled together
    prompts = [prompt(processor, "Compare these.", [RED, BLUE]),
               prompt(processor, "What colour is this picture, please?", [GREEN])]
    items = [mm_items(ids, px, place.token_id, place.tokens) for ids, px in prompts]
    tables = [tuple(range(3, 3 + 16)), tuple(range(40, 40 + 16))[::-1]]
    out = w.execute(StepInput(tuple(
        RowInput(tuple(ids), 0, t, True, True, slices(it, 0, len(ids)))
        for (ids, _), t, it in zip(prompts, tables, items))))
    assert calls == [3]  # all three images of the step in one batch
    seqs = [list(ids) for ids, _ in prompts]
    for i, (ids, px) in enumerate(prompts):
        ref = reference(hf, ids, px)
        torch.testing.assert_close(out.all_logits[i], ref, **TOL)
        torch.testing.assert_close(out.logits[i], ref[-1], **TOL)
    for _ in range(4):
        nxt = [int(out.logits[i].argmax()) for i in range(len(seqs))]
        rows = []
        for i, seq in enumerate(seqs):
            seq.append(nxt[i])
            rows.append(RowInput((nxt[i],), len(seq) - 1, tables[i], True))
        out = w.execute(StepInput(tuple(rows)))
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(out.logits[i], reference(hf, seq, prompts[i][1])[-1], **TOL)
    assert calls == [3]  # decode steps carry no images


def test_chunked_prefill_split_inside_an_image(folder: Path, processor, hf) -> None:
    w = worker(folder)
    calls = count_encodes(w)
    place = image_placeholder(w.runner.model.config)
    ids, px = prompt(processor, "Describe.", [RED, BLUE])
    items = mm_items(ids, px, place.token_id, place.tokens)
    whole = w.execute(StepInput((RowInput(tuple(ids), 0, tuple(range(1, 17)), True, True,
                                          slices(items, 0, len(ids))),)))
    # cuts inside the first image, just inside the second, and one chunk all image
    first, second = items[0].offset, items[1].offset
    cuts = [0, first + 5, first + 11, second + 1, len(ids)]
    assert all(b - a > 0 for a, b in zip(cuts, cuts[1:]))
    table = tuple(range(20, 36))
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        out = w.execute(StepInput((RowInput(tuple(ids[a:b]), a, table, b == len(ids), True,
                                            slices(items, a, b)),)))
        parts.append(out.all_logits[0])
    torch.testing.assert_close(torch.cat(parts), whole.all_logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[0], whole.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(parts), reference(hf, ids, px), **TOL)
    assert calls == [2]  # the chunks read the images' cached rows


def test_encoder_cache_reuses_rows_and_images_matter(folder: Path, processor) -> None:
    w = worker(folder)
    calls = count_encodes(w)
    place = image_placeholder(w.runner.model.config)

    def run(image: Image.Image, table: tuple[int, ...]) -> torch.Tensor:
        ids, px = prompt(processor, "What is it?", [image])
        items = mm_items(ids, px, place.token_id, place.tokens)
        row = RowInput(tuple(ids), 0, table, True, False, slices(items, 0, len(ids)))
        return w.execute(StepInput((row,))).logits[0]

    red = run(RED, tuple(range(0, 10)))
    again = run(RED, tuple(range(10, 20)))
    assert calls == [1]  # the second request's image came from the cache
    assert torch.equal(red, again)
    blue = run(BLUE, tuple(range(20, 30)))
    assert calls == [1, 1]
    assert (blue - red).abs().max() > 0.1  # the logits depend on the image
    # bounded by rows: room for one image only, so red was evicted by blue
    w.runner.encoder_cache_rows = place.tokens
    run(GREEN, tuple(range(30, 40)))
    assert len(w.runner.encoder_cache) == 1
    torch.testing.assert_close(run(RED, tuple(range(40, 50))), red, atol=1e-6, rtol=1e-6)
    assert calls == [1, 1, 1, 1]


def _hf_layout(name: str) -> str:
    """A transformers-5 save's tensor name in the transformers >= 4.52 loaded layout."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("vision_tower."):
        return "model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return "model." + name


def test_checkpoint_names_of_both_layouts(folder: Path) -> None:
    model = LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(folder))
    new = {  # transformers >= 4.52
        "model.language_model.layers.0.self_attn.q_proj.weight":
            ("language_model.layers.0.self_attn.qkv_proj.weight", 0),
        "model.language_model.layers.3.mlp.up_proj.weight":
            ("language_model.layers.3.mlp.gate_up_proj.weight", 1),
        "model.language_model.embed_tokens.weight": ("language_model.embed_tokens.weight", 0),
        "lm_head.weight": ("language_model.lm_head.weight", 0),
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.bias":
            ("vision_tower.encoder.layers.0.self_attn.k_proj.bias", 0),
        "model.vision_tower.vision_model.embeddings.class_embedding":
            ("vision_tower.embeddings.class_embedding", 0),
        "model.multi_modal_projector.linear_1.weight": ("multi_modal_projector.linear_1.weight", 0),
    }
    old = {  # transformers < 4.52, and (vision tower without vision_model.) transformers 5's save
        "language_model.model.layers.1.self_attn.v_proj.weight":
            ("language_model.layers.1.self_attn.qkv_proj.weight", 2),
        "language_model.model.layers.2.mlp.gate_proj.weight":
            ("language_model.layers.2.mlp.gate_up_proj.weight", 0),
        "language_model.model.norm.weight": ("language_model.norm.weight", 0),
        "language_model.lm_head.weight": ("language_model.lm_head.weight", 0),
        "vision_tower.vision_model.pre_layrnorm.weight": ("vision_tower.pre_layrnorm.weight", 0),
        "vision_tower.encoder.layers.0.mlp.fc1.weight":
            ("vision_tower.encoder.layers.0.mlp.fc1.weight", 0),
        "multi_modal_projector.linear_2.bias": ("multi_modal_projector.linear_2.bias", 0),
    }
    params = assert_checkpoint_names(model, {**new, **old})
    # only the layers the features read are built: layer 1 of 2 and the post-layernorm are not
    assert "vision_tower.encoder.layers.1.mlp.fc1.weight" not in params
    assert model.checkpoint_name("vision_tower.post_layernorm.weight")[0] not in params


def test_loads_the_newer_layout_to_the_same_logits(folder: Path, processor,
                                                   tmp_path: Path) -> None:
    tensors = resave_renamed(folder, tmp_path, _hf_layout)
    assert any(n.startswith("language_model.model.") for n in tensors)  # transformers 5's save
    place = image_placeholder(transformers.AutoConfig.from_pretrained(folder))
    ids, px = prompt(processor, "Same?", [BLUE])
    assert_same_logits(folder, tmp_path, RowInput(
        tuple(ids), 0, tuple(range(10)), True, False,
        slices(mm_items(ids, px, place.token_id, place.tokens), 0, len(ids))))


def _random_llava(tmp: Path, vision: transformers.PretrainedConfig, layer: int | list[int],
                  strategy: str, tie: bool = False) -> transformers.LlavaForConditionalGeneration:
    text = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, tie_word_embeddings=tie)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=127,
                                      vision_feature_layer=layer,
                                      vision_feature_select_strategy=strategy,
                                      projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():  # unit-scale activations: transformers' 0.02 init hides mistakes
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("class_embedding"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(tmp)
    return model.eval()


@pytest.mark.parametrize("tower,layer,strategy", [
    ("clip", [-3, -1], "full"),  # the embeddings and the last layer, concatenated, class row kept
    ("clip", 1, "default"),
    ("siglip", -2, "full"),
    ("siglip", -1, "default"),  # transformers drops SigLIP's first patch too: so do we
])
def test_encode_matches_transformers_image_features(tmp_path: Path, tower: str,
                                                    layer: int | list[int], strategy: str) -> None:
    common = dict(image_size=28, patch_size=7, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4)
    vision = (transformers.CLIPVisionConfig(**common, hidden_act="quick_gelu") if tower == "clip"
              else transformers.SiglipVisionConfig(**common))
    hf_model = _random_llava(tmp_path, vision, layer, strategy)
    ours = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=8, block_size=BLOCK))
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model.model.get_image_features(pixel_values=pixels).pooler_output
    got = ours.runner.model.encode("image", [{"pixel_values": p.numpy()} for p in pixels])
    assert [g.shape[0] for g in got] == [image_placeholder(hf_model.config).tokens] * 3
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_tied_decoder_embeddings_load_as_the_head(tmp_path: Path) -> None:
    vision = transformers.CLIPVisionConfig(image_size=28, patch_size=7, hidden_size=32,
                                           intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4)
    hf_model = _random_llava(tmp_path, vision, -2, "default", tie=True)
    ours = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=8, block_size=BLOCK))
    ids = [5, 17, 42, 7]
    out = ours.execute(StepInput((RowInput(tuple(ids), 0, (1, 2), True),)))
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], ref, **TOL)
