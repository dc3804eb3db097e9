"""Qwen2.5-VL in our model code (windowed vision transformer, patch merger, our Qwen2 decoder with
M-RoPE on the paged cache) gives transformers' logits on the same weights:
`shardserve/tiny-qwen2.5-vl`, synthetic gradients of different sizes through the folder's own
image processor, 3-D positions from transformers' own `get_rope_index`. Float32 throughout;
logits agree within atol 1e-4 + rtol 1e-4 (the text models' parity bound; the measured gap is
~6e-6 on logits up to ~4.5, from summation order).

Without torchvision, transformers' `AutoProcessor` cannot build the Qwen2.5-VL processor (its
video processor needs torchvision), so prompts are made as the ingress makes them: the folder's
tokenizer renders the chat, its image processor makes each image's patch rows and grid, and each
`<|image_pad|>` is expanded to t*h*w / merge^2 copies (what the processor's
`replace_image_token` does)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

from replicas import kernels
from replicas.embedded import ensure_tiny_qwen2_5_vl
from replicas.model_runner import RowInput, StepInput
from replicas.models import get_model_class, text_config
from replicas.models.qwen2_5_vl import (
    MRotaryEmbedding,
    Qwen2_5_VLForConditionalGeneration,
    image_tokens,
)
from replicas.models.rope import RotaryEmbedding
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
    return ensure_tiny_qwen2_5_vl(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def images(folder: Path):
    return transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def hf(folder: Path) -> transformers.Qwen2_5_VLForConditionalGeneration:
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


RED = gradient((255, 40, 0), (112, 84))  # 8 x 6 patches: 12 tokens, in 4 windows
BLUE = gradient((0, 90, 255), (56, 56), vertical=True)  # 4 x 4 patches: 4 tokens
GREEN = gradient((30, 220, 60), (84, 112))  # 6 x 8 patches: 12 tokens


class Prompt:
    """A chat prompt with images, as the ingress builds it, and transformers' inputs for it."""

    def __init__(self, tokenizer, images, hf, parts: list[str | Image.Image]) -> None:
        content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p}
                   for p in parts]
        chat = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
        pictures = [p for p in parts if isinstance(p, Image.Image)]
        token_id = hf.config.image_token_id
        merge = images.merge_size
        ids = tokenizer(chat)["input_ids"]
        self.inputs: dict[str, torch.Tensor] = {}
        self.items: list[MultiModalItem] = []
        if pictures:
            out = images(pictures, return_tensors="pt")
            grids = out["image_grid_thw"]
            rows = out["pixel_values"].split((grids.prod(-1)).tolist())
            expanded: list[int] = []
            k = 0
            for t in ids:
                if t != token_id:
                    expanded.append(t)
                    continue
                n = int(grids[k].prod()) // merge ** 2
                data = {"pixel_values": rows[k].numpy(), "image_grid_thw": grids[k].numpy()}
                key = hashlib.blake2b(data["pixel_values"].tobytes()
                                      + data["image_grid_thw"].tobytes(), digest_size=32).digest()
                self.items.append(MultiModalItem("image", len(expanded), n, key, data))
                expanded.extend([token_id] * n)
                k += 1
            assert k == len(pictures)
            ids = expanded
            self.inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": grids,
                           "mm_token_type_ids": torch.tensor([[int(t == token_id) for t in ids]])}
            # transformers' own 3-D positions; a token p past the prompt is at p + delta
            positions, delta = hf.model.get_rope_index(
                torch.tensor([ids]), self.inputs["mm_token_type_ids"], image_grid_thw=grids)
            self.mrope: np.ndarray | None = positions[:, 0].numpy()
            self.delta = int(delta)
        else:
            self.mrope, self.delta = None, 0
        self.ids = ids

    def row(self, start: int, end: int, table: tuple[int, ...], all_logits: bool = True,
            sample: bool = True) -> RowInput:
        """The prompt's tokens [start, end) as one step's row."""
        mrope = None if self.mrope is None else self.mrope[:, start:end]
        return RowInput(tuple(self.ids[start:end]), start, table, sample, all_logits,
                        slices(self.items, start, end), mrope)

    def decode_row(self, seq: list[int], table: tuple[int, ...]) -> RowInput:
        """The last token of `seq` (the prompt and generated tokens) as a decode row."""
        p = len(seq) - 1
        mrope = None if self.mrope is None else np.full((3, 1), p + self.delta, dtype=np.int64)
        return RowInput((seq[-1],), p, table, True, False, (), mrope)

    def reference(self, hf, seq: list[int] | None = None) -> torch.Tensor:
        """transformers' logits of `seq` (default: the prompt), all positions."""
        seq = self.ids if seq is None else seq
        inputs = dict(self.inputs)
        if "mm_token_type_ids" in inputs:  # generated tokens are text
            inputs["mm_token_type_ids"] = torch.nn.functional.pad(
                inputs["mm_token_type_ids"], (0, len(seq) - len(self.ids)))
        with torch.no_grad():
            return hf(input_ids=torch.tensor([seq]), **inputs).logits[0]


def test_folder_describes_the_model(folder: Path, tokenizer, images, hf) -> None:
    config = transformers.AutoConfig.from_pretrained(folder)
    cls = get_model_class(config)
    assert cls is Qwen2_5_VLForConditionalGeneration
    assert cls.modalities == frozenset({"image", "video"}) and cls.uses_mrope
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert images.merge_size == config.vision_config.spatial_merge_size == 2
    assert text_config(config).num_hidden_layers == 4
    out = images([RED, BLUE, GREEN], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 6, 8], [1, 4, 4], [1, 8, 6]]
    assert out["pixel_values"].shape == (48 + 16 + 48, 3 * 2 * 14 * 14)
    assert [image_tokens(g, config) for g in out["image_grid_thw"]] == [12, 4, 12]
    p = Prompt(tokenizer, images, hf, ["Look:", RED, "and", BLUE, "Same?"])
    assert p.ids.count(config.image_token_id) == 16
    assert [(i.offset, i.length) for i in p.items] == [(7, 12), (24, 4)]
    assert tokenizer.decode(p.ids[6:8]) == "<|vision_start|><|image_pad|>"
    # an image's tokens take (t, row, column) of its merged grid (3 x 4 units) from where the
    # text stopped; the text after it goes on from there + the grid's longer side
    assert p.mrope[:, 7:11].T.tolist() == [[7, 7, 7], [7, 7, 8], [7, 7, 9], [7, 7, 10]]
    assert p.mrope[:, 18].tolist() == [7, 9, 10] and p.mrope[:, 19].tolist() == [11] * 3
    assert p.mrope[:, 24:28].T.tolist() == [[16, 16, 16], [16, 16, 17], [16, 17, 16],
                                            [16, 17, 17]]
    assert p.mrope[:, 28].tolist() == [18] * 3
    # each image's positions advance by its longer side, not by its token count
    assert p.delta == p.mrope[0, -1] + 1 - len(p.ids) == (4 - 12) + (2 - 4)
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ImportError, match="Torchvision"):
            transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    else:
        processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
        assert type(processor).__name__ == "Qwen2_5_VLProcessor"


def test_mrope_gives_transformers_cos_sin_and_text_the_1d_rope(folder: Path, hf) -> None:
    config = text_config(transformers.AutoConfig.from_pretrained(folder))
    ours = MRotaryEmbedding(config, 32)
    positions = torch.randint(0, 300, (3, 50), generator=torch.Generator().manual_seed(0))
    cos, sin = ours.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(torch.zeros(1), positions[:, None])
    # transformers' [T, D] repeats the D/2 angles: our layout is the first half
    torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :16], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], ref_sin[0, :, :16], atol=1e-6, rtol=0)
    assert torch.equal(ref_cos[0, :, :16], ref_cos[0, :, 16:])
    # text tokens (three equal axes) rotate exactly as the 1-D rope does
    text = torch.arange(7, 70)
    for a, b in zip(ours.cos_sin(text.expand(3, -1), torch.float32),
                    RotaryEmbedding(config, 32).cos_sin(text, torch.float32)):
        assert torch.equal(a, b) and a.is_contiguous()
    with pytest.raises(ValueError, match=r"\[3, tokens\]"):
        ours.cos_sin(text, torch.float32)


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_prefill_and_decode_match_transformers(folder: Path, tokenizer, images, hf,
                                               attention: str) -> None:
    w = worker(folder, attention)
    calls = count_encodes(w)
    # row 0: text before, between and after two images of different sizes; row 1: one image
    # and a longer text; row 2: text only (its positions fill all three axes); all together
    prompts = [Prompt(tokenizer, images, hf, ["Look:", RED, "and then", BLUE, "Same?"]),
               Prompt(tokenizer, images, hf, [GREEN, "What colour is this picture, please?"]),
               Prompt(tokenizer, images, hf, ["No picture here, only words."])]
    tables = [tuple(range(3, 19)), tuple(range(40, 56))[::-1], tuple(range(20, 36))]
    out = w.execute(StepInput(tuple(p.row(0, len(p.ids), t) for p, t in zip(prompts, tables))))
    assert calls == [3]  # all three images of the step in one tower call
    seqs = [list(p.ids) for p in prompts]
    for i, p in enumerate(prompts):
        ref = p.reference(hf)
        torch.testing.assert_close(out.all_logits[i], ref, **TOL)
        torch.testing.assert_close(out.logits[i], ref[-1], **TOL)
    for _ in range(4):
        for i, seq in enumerate(seqs):
            seq.append(int(out.logits[i].argmax()))
        out = w.execute(StepInput(tuple(p.decode_row(seq, t)
                                        for p, seq, t in zip(prompts, seqs, tables))))
        for i, (p, seq) in enumerate(zip(prompts, seqs)):
            torch.testing.assert_close(out.logits[i], p.reference(hf, seq)[-1], **TOL)
    assert calls == [3]  # decode steps carry no images


@pytest.mark.skipif(torch.cuda.is_available(), reason="workers pick a GPU")
def test_native_layers_run_m_rope_steps_as_the_python_layers(folder: Path, tokenizer, images, hf,
                                                             tmp_path: Path) -> None:
    """kernels.llama_layers takes cos/sin from the rope, so M-RoPE needs nothing of it: over
    a prefill with images and a text-only row and then decode steps, the native layers give the
    Python layers' logits to the bit. They run on packed weights: a bf16 checkpoint computing in
    float32 (every build packs it), which the float32 tiny model is not."""
    if kernels.load() is None:
        pytest.skip("no native kernels here")
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(folder / "model.safetensors").items()},
              tmp_path / "model.safetensors")
    workers = [worker(tmp_path) for _ in range(2)]
    python = workers[1].runner.model.language_model
    python._native_layers = lambda kv_cache, meta: None
    prompts = [Prompt(tokenizer, images, hf, ["Look:", RED, "and then", BLUE, "Same?"]),
               Prompt(tokenizer, images, hf, ["No picture here, only words."])]
    tables = [tuple(range(3, 19)), tuple(range(20, 36))]
    step = StepInput(tuple(p.row(0, len(p.ids), t) for p, t in zip(prompts, tables)))
    outs = [w.execute(step) for w in workers]
    seqs = [list(p.ids) for p in prompts]
    native = workers[0].runner.model.language_model
    for _ in range(4):
        assert torch.equal(outs[0].logits, outs[1].logits)
        for i, seq in enumerate(seqs):
            seq.append(int(outs[0].logits[i].argmax()))
        native._native_table = None  # built again only where the native layers run the step
        step = StepInput(tuple(p.decode_row(seq, t) for p, seq, t in zip(prompts, seqs, tables)))
        outs = [w.execute(step) for w in workers]
        assert native._native_table is not None and native._native_table[1] is not None
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert python._native_table is None


def test_chunked_prefill_split_inside_an_image(folder: Path, tokenizer, images, hf) -> None:
    w = worker(folder)
    calls = count_encodes(w)
    p = Prompt(tokenizer, images, hf, ["Describe.", RED, GREEN, "Briefly."])
    whole = w.execute(StepInput((p.row(0, len(p.ids), tuple(range(1, 17))),)))
    # cuts inside the first image, just inside the second, and one chunk all image
    first, second = p.items[0].offset, p.items[1].offset
    cuts = [0, first + 5, first + 11, second + 1, second + 9, len(p.ids)]
    assert all(b - a > 0 for a, b in zip(cuts, cuts[1:]))
    table = tuple(range(20, 36))
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        out = w.execute(StepInput((p.row(a, b, table, sample=b == len(p.ids)),)))
        parts.append(out.all_logits[0])
    torch.testing.assert_close(torch.cat(parts), whole.all_logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[0], whole.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(parts), p.reference(hf), **TOL)
    assert calls == [2]  # the chunks read the images' cached rows


def test_encoder_cache_reuses_rows_and_images_matter(folder: Path, tokenizer, images, hf) -> None:
    w = worker(folder)
    calls = count_encodes(w)

    def run(image: Image.Image, table: tuple[int, ...]) -> torch.Tensor:
        p = Prompt(tokenizer, images, hf, [image, "What is it?"])
        return w.execute(StepInput((p.row(0, len(p.ids), table, all_logits=False),))).logits[0]

    red = run(RED, tuple(range(0, 10)))
    again = run(RED, tuple(range(10, 20)))
    assert calls == [1]  # the second request's image came from the cache
    assert torch.equal(red, again)
    green = run(GREEN, tuple(range(20, 30)))  # as many tokens, transposed grid
    assert calls == [1, 1]
    assert (green - red).abs().max() > 0.1  # the logits depend on the image
    # bounded by rows: room for one 12-row image only, so both earlier ones are evicted
    w.runner.encoder_cache_rows = 12
    run(BLUE, tuple(range(30, 40)))
    run(GREEN, tuple(range(40, 50)))
    assert len(w.runner.encoder_cache) == 1
    torch.testing.assert_close(run(RED, tuple(range(50, 60))), red, atol=1e-6, rtol=1e-6)
    assert calls == [1, 1, 1, 1, 1]


def test_encode_gives_transformers_image_features(folder: Path, images, hf) -> None:
    """Images of several grids in one tower call, windows splitting the larger ones."""
    pictures = [RED, BLUE, GREEN, gradient((200, 200, 30), (112, 112)),
                gradient((90, 10, 160), (60, 200), vertical=True)]
    out = images(pictures, return_tensors="pt")
    grids = out["image_grid_thw"]
    assert grids.tolist() == [[1, 6, 8], [1, 4, 4], [1, 8, 6], [1, 8, 8], [1, 14, 4]]
    with torch.no_grad():
        ref = hf.model.get_image_features(out["pixel_values"], grids).pooler_output
    model = worker(folder, num_blocks=8).runner.model
    rows = out["pixel_values"].split(grids.prod(-1).tolist())
    data = [{"pixel_values": r.numpy(), "image_grid_thw": g.numpy()} for r, g in zip(rows, grids)]
    got = model.encode("image", data)
    assert [g.shape[0] for g in got] == [12, 4, 12, 16, 14]
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    # 56 px windows hold 2 x 2 merged units (16 patches): RED's 3 x 4 units make four windows
    _, _, windows, frames = model.visual._layout([tuple(g) for g in grids.tolist()][:2])
    assert windows == [16, 16, 8, 8, 16] and frames == [48, 16]
    alone = model.encode("image", [data[4]])[0]
    torch.testing.assert_close(alone, got[4], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="patch rows"):
        model.encode("image", [{**data[0], "pixel_values": data[0]["pixel_values"][:40]}])
    with pytest.raises(ValueError, match="patch rows"):
        model.encode("image", [{**data[0], "image_grid_thw": np.array([1, 5, 8])}])
    with pytest.raises(ValueError, match="encodes images and videos"):
        model.encode("audio", data[:1])


def test_encode_gives_transformers_video_features(folder: Path, hf) -> None:
    """A video is temporal patches through the same tower: 5 frames (padded to 6: three
    temporal patches) of changing gradients, beside an image, as transformers encodes them."""
    from serve_app.video_patches import patchify

    rng = np.random.default_rng(3)
    frames = rng.normal(size=(5, 3, 56, 84)).astype(np.float32)
    pixels, grid = patchify(frames, 14, 2, 2)
    assert grid.tolist() == [3, 4, 6]
    with torch.no_grad():
        ref = hf.model.get_video_features(torch.from_numpy(pixels),
                                          torch.from_numpy(grid[None])).pooler_output[0]
    model = worker(folder, num_blocks=8).runner.model
    got = model.encode("video", [{"pixel_values": pixels, "video_grid_thw": grid}])[0]
    assert got.shape[0] == 3 * 4 * 6 // 4
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _loaded_layout(name: str) -> str:
    """A transformers-5 save's tensor name in the transformers >= 4.52 loaded layout."""
    if name.startswith(("model.", "visual.")):
        return "model." + ("language_model." + name.removeprefix("model.")
                           if name.startswith("model.") else name)
    return name


def test_checkpoint_names_of_both_layouts(folder: Path) -> None:
    model = Qwen2_5_VLForConditionalGeneration(transformers.AutoConfig.from_pretrained(folder))
    new = {  # transformers >= 4.52, loaded
        "model.language_model.layers.0.self_attn.q_proj.weight":
            ("language_model.layers.0.self_attn.qkv_proj.weight", 0),
        "model.language_model.layers.1.self_attn.k_proj.bias":
            ("language_model.layers.1.self_attn.qkv_proj.bias", 1),
        "model.language_model.layers.3.mlp.up_proj.weight":
            ("language_model.layers.3.mlp.gate_up_proj.weight", 1),
        "model.language_model.embed_tokens.weight": ("language_model.embed_tokens.weight", 0),
        "lm_head.weight": ("language_model.lm_head.weight", 0),
        "model.visual.blocks.0.attn.qkv.weight": ("visual.blocks.0.attn.qkv.weight", 0),
        # the tower's MLP keeps its unfused gate/up names
        "model.visual.blocks.2.mlp.gate_proj.bias": ("visual.blocks.2.mlp.gate_proj.bias", 0),
        "model.visual.merger.mlp.2.weight": ("visual.merger.mlp.2.weight", 0),
    }
    old = {  # the Qwen2.5-VL checkpoints', and transformers 5's save
        "model.layers.1.self_attn.v_proj.bias":
            ("language_model.layers.1.self_attn.qkv_proj.bias", 2),
        "model.layers.2.mlp.gate_proj.weight":
            ("language_model.layers.2.mlp.gate_up_proj.weight", 0),
        "model.norm.weight": ("language_model.norm.weight", 0),
        "model.embed_tokens.weight": ("language_model.embed_tokens.weight", 0),
        "visual.patch_embed.proj.weight": ("visual.patch_embed.proj.weight", 0),
        "visual.blocks.3.mlp.up_proj.weight": ("visual.blocks.3.mlp.up_proj.weight", 0),
        "visual.blocks.1.norm2.weight": ("visual.blocks.1.norm2.weight", 0),
        "visual.merger.ln_q.weight": ("visual.merger.ln_q.weight", 0),
    }
    params = assert_checkpoint_names(model, {**new, **old})
    saved = load_file(folder / "model.safetensors")
    assert {model.checkpoint_name(n)[0] for n in saved} == set(params)


def test_loads_the_newer_layout_to_the_same_logits(folder: Path, tokenizer, images, hf,
                                                   tmp_path: Path) -> None:
    tensors = resave_renamed(folder, tmp_path, _loaded_layout)
    assert any(n.startswith("model.layers.") for n in tensors)  # transformers 5's save
    assert any(n.startswith("visual.") for n in tensors)
    p = Prompt(tokenizer, images, hf, [BLUE, "Same?"])
    assert_same_logits(folder, tmp_path, p.row(0, len(p.ids), tuple(range(10)), all_logits=False))


def test_tied_embeddings_load_as_the_head(tmp_path: Path) -> None:
    """Qwen2.5-VL-3B ties its head to the embeddings (the checkpoint has no lm_head)."""
    config = transformers.Qwen2_5_VLConfig(
        text_config={"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                         "mrope_section": [2, 3, 3]},
                     "bos_token_id": None, "eos_token_id": None},
        vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
                       "out_hidden_size": 64, "fullatt_block_indexes": [0]},
        image_token_id=127, video_token_id=126, vision_start_token_id=125,
        vision_end_token_id=124, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # unit-scale activations: transformers' 0.02 init hides mistakes
        for name, p in hf_model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    hf_model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    ours = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=8, block_size=BLOCK))
    ids = [5, 17, 42, 7]
    out = ours.execute(StepInput((RowInput(tuple(ids), 0, (1, 2), True),)))
    with torch.no_grad():
        ref = hf_model.eval()(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], ref, **TOL)
