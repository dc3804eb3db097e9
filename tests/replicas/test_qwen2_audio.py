"""Qwen2-Audio in our model code (Whisper-style encoder, projector, our Qwen2 decoder on the paged
cache) gives transformers' logits on the same weights: `shardserve/tiny-qwen2-audio`, sine waves
at 16 kHz through the folder's own processor. Float32 throughout; logits agree within atol 1e-4 +
rtol 1e-4 (the text models' parity bound; the measured gap is ~3e-6 on logits up to ~4.5, from
summation order)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from replicas.embedded import ensure_tiny_qwen2_audio
from replicas.model_runner import RowInput, StepInput
from replicas.models import get_model_class, text_config
from replicas.models.qwen2_audio import (
    Qwen2AudioForConditionalGeneration,
    audio_token_id,
    audio_tokens,
)
from replicas.request import MultiModalItem
from replicas.worker import ShardWorker, WorkerConfig
from tests.replicas.mm_steps import (
    BLOCK,
    TOL,
    assert_checkpoint_names,
    assert_same_logits,
    count_encodes,
    resave_renamed,
    slices,
    worker,
)

RATE = 16000


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_qwen2_audio(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def processor(folder: Path):
    return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def hf(folder: Path) -> transformers.Qwen2AudioForConditionalGeneration:
    return transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


def sine(hz: float, seconds: float) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


SHORT = sine(440, 0.5)  # 50 feature frames: 12 audio tokens
LONG = sine(700, 1.3)  # 130 frames: 32 tokens
OTHER = sine(300, 0.8)  # 80 frames: 20 tokens


def prompt(processor, text: str, audios: list[np.ndarray]) -> tuple[list[int], dict]:
    """The chat prompt's ids (each `<|AUDIO|>` expanded by the processor) and transformers'
    audio inputs for it."""
    content = [{"type": "audio"} for _ in audios] + [{"type": "text", "text": text}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    out = processor(text=chat, audio=audios, sampling_rate=RATE, return_tensors="pt")
    return out["input_ids"][0].tolist(), {k: out[k] for k in ("input_features",
                                                              "feature_attention_mask")}


def features(processor, audio: np.ndarray) -> dict[str, np.ndarray]:
    """One audio's encoder inputs, as the ingress makes them."""
    out = processor.feature_extractor(audio, sampling_rate=RATE, return_attention_mask=True,
                                      padding="max_length", return_tensors="np")
    return {"input_features": out["input_features"][0],
            "feature_attention_mask": out["attention_mask"][0]}


def mm_items(processor, ids: list[int], audios: list[np.ndarray]) -> list[MultiModalItem]:
    """One item per audio: its run of placeholder tokens (in prompt order) and its features,
    keyed by a hash of them."""
    token_id = processor.audio_token_id
    starts = [i for i, t in enumerate(ids) if t == token_id and (i == 0 or ids[i - 1] != token_id)]
    items = []
    for offset, audio in zip(starts, audios, strict=True):
        data = features(processor, audio)
        n = audio_tokens(int(data["feature_attention_mask"].sum()))
        assert ids[offset:offset + n] == [token_id] * n and ids[offset + n] != token_id
        key = hashlib.blake2b(data["input_features"].tobytes()
                              + data["feature_attention_mask"].tobytes(), digest_size=32).digest()
        items.append(MultiModalItem("audio", offset, n, key, data))
    return items


def reference(hf, ids: list[int], audio: dict) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), **audio).logits[0]


def test_folder_describes_the_model(folder: Path, processor) -> None:
    config = transformers.AutoConfig.from_pretrained(folder)
    assert get_model_class(config) is Qwen2AudioForConditionalGeneration
    assert get_model_class(config).modalities == frozenset({"audio"})
    assert audio_token_id(config) == processor.audio_token_id
    assert processor.audio_token_id == processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert text_config(config).model_type == "qwen2"
    assert text_config(config).num_hidden_layers == 4
    ids, audio = prompt(processor, "Two?", [SHORT, LONG])
    assert audio["input_features"].shape == (2, 128, 3000)
    assert audio["feature_attention_mask"].sum(-1).tolist() == [50, 130]
    assert [audio_tokens(50), audio_tokens(130)] == [12, 32]
    assert ids.count(processor.audio_token_id) == 44
    # the ingress's one-audio-at-a-time features are the processor's batch
    for i, clip in enumerate([SHORT, LONG]):
        one = features(processor, clip)
        assert np.array_equal(one["input_features"], audio["input_features"][i].numpy())
        assert np.array_equal(one["feature_attention_mask"],
                              audio["feature_attention_mask"][i].numpy())


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_prefill_and_decode_match_transformers(folder: Path, processor, hf,
                                               attention: str) -> None:
    w = worker(folder, attention, num_blocks=96)
    calls = count_encodes(w)
    # row 0: two audios of different lengths; row 1: one audio and a longer text; together
    clips = [[SHORT, LONG], [OTHER]]
    prompts = [prompt(processor, "Compare these.", clips[0]),
               prompt(processor, "What sound is this, please?", clips[1])]
    items = [mm_items(processor, ids, c) for (ids, _), c in zip(prompts, clips)]
    tables = [tuple(range(3, 3 + 24)), tuple(range(40, 40 + 24))[::-1]]
    out = w.execute(StepInput(tuple(
        RowInput(tuple(ids), 0, t, True, True, slices(it, 0, len(ids)))
        for (ids, _), t, it in zip(prompts, tables, items))))
    assert calls == [3]  # all three audios of the step in one batch
    seqs = [list(ids) for ids, _ in prompts]
    for i, (ids, audio) in enumerate(prompts):
        ref = reference(hf, ids, audio)
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
            torch.testing.assert_close(out.logits[i], reference(hf, seq, prompts[i][1])[-1],
                                       **TOL)
    assert calls == [3]  # decode steps carry no audio


def test_chunked_prefill_split_inside_an_audio(folder: Path, processor, hf) -> None:
    w = worker(folder, num_blocks=96)
    calls = count_encodes(w)
    ids, audio = prompt(processor, "Describe.", [SHORT, LONG])
    items = mm_items(processor, ids, [SHORT, LONG])
    whole = w.execute(StepInput((RowInput(tuple(ids), 0, tuple(range(1, 25)), True, True,
                                          slices(items, 0, len(ids))),)))
    # cuts inside the first audio, just inside the second, and one chunk all audio
    first, second = items[0].offset, items[1].offset
    cuts = [0, first + 5, first + 9, second + 1, second + 20, len(ids)]
    assert all(b - a > 0 for a, b in zip(cuts, cuts[1:]))
    table = tuple(range(30, 54))
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        out = w.execute(StepInput((RowInput(tuple(ids[a:b]), a, table, b == len(ids), True,
                                            slices(items, a, b)),)))
        parts.append(out.all_logits[0])
    torch.testing.assert_close(torch.cat(parts), whole.all_logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[0], whole.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(parts), reference(hf, ids, audio), **TOL)
    assert calls == [2]  # the chunks read the audios' cached rows


def test_encoder_cache_reuses_rows_and_audio_matters(folder: Path, processor) -> None:
    w = worker(folder, num_blocks=96)
    calls = count_encodes(w)

    def run(clip: np.ndarray, table: tuple[int, ...]) -> torch.Tensor:
        ids, _ = prompt(processor, "What is it?", [clip])
        items = mm_items(processor, ids, [clip])
        row = RowInput(tuple(ids), 0, table, True, False, slices(items, 0, len(ids)))
        return w.execute(StepInput((row,))).logits[0]

    short = run(SHORT, tuple(range(0, 12)))
    again = run(SHORT, tuple(range(12, 24)))
    assert calls == [1]  # the second request's audio came from the cache
    assert torch.equal(short, again)
    other = run(sine(660, 0.5), tuple(range(24, 36)))  # as long, another pitch
    assert calls == [1, 1]
    assert (other - short).abs().max() > 0.1  # the logits depend on the audio
    # bounded by rows: room for one 32-row audio only, so both earlier ones are evicted
    w.runner.encoder_cache_rows = audio_tokens(130)
    run(LONG, tuple(range(36, 60)))
    assert len(w.runner.encoder_cache) == 1
    torch.testing.assert_close(run(SHORT, tuple(range(60, 72))), short, atol=1e-6, rtol=1e-6)
    assert calls == [1, 1, 1, 1]


def test_encode_gives_the_rows_transformers_puts_at_the_placeholders(folder: Path, processor,
                                                                     hf) -> None:
    """Lengths whose convolution output is odd and even and a whole 30 s window, in one batch
    padded to the longest."""
    clips = [sine(500, 0.49), sine(350, 0.51), sine(250, 30.0), SHORT]
    text = "".join("<|audio_bos|><|AUDIO|><|audio_eos|>" for _ in clips) + "Go."
    out = processor(text=text, audio=clips, sampling_rate=RATE, return_tensors="pt")
    frames = out["feature_attention_mask"].sum(-1).tolist()
    assert frames == [49, 51, 3000, 50]
    captured: dict[str, torch.Tensor] = {}

    def grab(module, args, kwargs) -> None:
        captured["embeds"] = kwargs["inputs_embeds"][0]

    hook = hf.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(**out)
    finally:
        hook.remove()
    ids = out["input_ids"][0]
    placeholders = (ids == processor.audio_token_id).nonzero().flatten()
    model = worker(folder, num_blocks=8).runner.model
    got = model.encode("audio", [features(processor, c) for c in clips])
    assert [g.shape[0] for g in got] == [audio_tokens(f) for f in frames] == [12, 13, 750, 12]
    torch.testing.assert_close(torch.cat(got), captured["embeds"][placeholders],
                               atol=1e-5, rtol=1e-5)
    # one at a time (no padding in the batch, nothing masked) gives the same rows
    for i in (0, 2):
        alone = model.encode("audio", [features(processor, clips[i])])[0]
        torch.testing.assert_close(alone, got[i], atol=1e-5, rtol=1e-5)
    bad = features(processor, SHORT)
    with pytest.raises(ValueError, match="audio features must be"):
        model.encode("audio", [{**bad, "input_features": bad["input_features"][:, :1500]}])
    with pytest.raises(ValueError, match="encodes audio"):
        model.encode("image", [bad])


def _loaded_layout(name: str) -> str:
    """A transformers-5 save's tensor name in the transformers >= 4.52 loaded layout."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


def test_checkpoint_names_of_both_layouts(folder: Path) -> None:
    model = Qwen2AudioForConditionalGeneration(transformers.AutoConfig.from_pretrained(folder))
    new = {  # transformers >= 4.52, loaded
        "model.language_model.layers.0.self_attn.q_proj.weight":
            ("language_model.layers.0.self_attn.qkv_proj.weight", 0),
        "model.language_model.layers.1.self_attn.k_proj.bias":
            ("language_model.layers.1.self_attn.qkv_proj.bias", 1),
        "model.language_model.layers.3.mlp.up_proj.weight":
            ("language_model.layers.3.mlp.gate_up_proj.weight", 1),
        "model.language_model.embed_tokens.weight": ("language_model.embed_tokens.weight", 0),
        "lm_head.weight": ("language_model.lm_head.weight", 0),
        "model.audio_tower.layers.0.self_attn.k_proj.weight":
            ("audio_tower.layers.0.self_attn.k_proj.weight", 0),  # the encoder's stay unfused
        "model.audio_tower.embed_positions.weight": ("audio_tower.embed_positions.weight", 0),
        "model.multi_modal_projector.linear.weight": ("multi_modal_projector.linear.weight", 0),
    }
    old = {  # Qwen2-Audio-7B's, and transformers 5's save
        "language_model.model.layers.1.self_attn.v_proj.bias":
            ("language_model.layers.1.self_attn.qkv_proj.bias", 2),
        "language_model.model.layers.2.mlp.gate_proj.weight":
            ("language_model.layers.2.mlp.gate_up_proj.weight", 0),
        "language_model.model.norm.weight": ("language_model.norm.weight", 0),
        "language_model.lm_head.weight": ("language_model.lm_head.weight", 0),
        "audio_tower.conv2.weight": ("audio_tower.conv2.weight", 0),
        "audio_tower.layers.1.self_attn.q_proj.bias":
            ("audio_tower.layers.1.self_attn.q_proj.bias", 0),
        "audio_tower.layers.1.final_layer_norm.weight":
            ("audio_tower.layers.1.final_layer_norm.weight", 0),
        "audio_tower.layer_norm.bias": ("audio_tower.layer_norm.bias", 0),
        "multi_modal_projector.linear.bias": ("multi_modal_projector.linear.bias", 0),
    }
    params = assert_checkpoint_names(model, {**new, **old})
    saved = load_file(folder / "model.safetensors")
    assert {model.checkpoint_name(n)[0] for n in saved} == set(params)


def test_loads_the_newer_layout_to_the_same_logits(folder: Path, processor,
                                                   tmp_path: Path) -> None:
    tensors = resave_renamed(folder, tmp_path, _loaded_layout)
    assert any(n.startswith("language_model.model.") for n in tensors)  # transformers 5's save
    ids, _ = prompt(processor, "Same?", [LONG])
    assert_same_logits(folder, tmp_path, RowInput(
        tuple(ids), 0, tuple(range(16)), True, False,
        slices(mm_items(processor, ids, [LONG]), 0, len(ids))))


def test_head_stays_untied_as_in_transformers(tmp_path: Path) -> None:
    """transformers ties no Qwen2-Audio weights, even where text_config says to: the saved
    head is loaded as is."""
    text = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, tie_word_embeddings=True)
    audio = transformers.Qwen2AudioEncoderConfig(d_model=32, encoder_layers=1,
                                                 encoder_attention_heads=4, encoder_ffn_dim=48,
                                                 num_mel_bins=128)
    config = transformers.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                           audio_token_index=127)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():  # unit-scale activations: transformers' 0.02 init hides mistakes
        for name, p in hf_model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    assert not torch.equal(hf_model.lm_head.weight,
                           hf_model.model.language_model.embed_tokens.weight)
    hf_model.save_pretrained(tmp_path)
    ours = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=8, block_size=BLOCK))
    ids = [5, 17, 42, 7]
    out = ours.execute(StepInput((RowInput(tuple(ids), 0, (1, 2), True),)))
    with torch.no_grad():
        ref = hf_model.eval()(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], ref, **TOL)
