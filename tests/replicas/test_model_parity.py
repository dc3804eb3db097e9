"""Our Llama-family code on the paged cache gives transformers' logits on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from replicas import kernels
from replicas.model_runner import RowInput, StepInput
from replicas.worker import ShardWorker, WorkerConfig

BLOCK = 4
# where the native kernels pack bf16 weights (a CPU with AVX512-BF16)
PACKS = kernels.packs_linear(torch.zeros(1, 2, dtype=torch.bfloat16))


def _make(tmp: Path, arch: str) -> transformers.PreTrainedModel:
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=16))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    model.save_pretrained(tmp)
    return model.eval()


def _worker(tmp: Path, num_blocks: int, attention: str,
            kv_cache_dtype: str | None = None) -> ShardWorker:
    """A float32 worker on `tmp`'s model; attention "torch": the path of machines without the
    native kernels (gathered decode rows, SDPA per prefill row)."""
    worker = ShardWorker(WorkerConfig(str(tmp), "float32", num_blocks=num_blocks,
                                      block_size=BLOCK, kv_cache_dtype=kv_cache_dtype))
    if attention == "torch":
        worker.runner.native_decode = worker.runner.native_prefill = False
    return worker


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_paged_decode_match_transformers(tmp_path: Path, arch: str,
                                                     attention: str) -> None:
    torch.manual_seed(0)
    hf = _make(tmp_path, arch)
    worker = _worker(tmp_path, 64, attention)
    prompts = [[5, 17, 42, 7, 99, 3, 11], [8, 1, 250, 33, 2]]
    tables = [(3, 9, 12), (20, 4, 7)]  # deliberately scattered blocks
    # prefill both rows in one step
    out = worker.execute(StepInput(tuple(
        RowInput(tuple(p), 0, t, True) for p, t in zip(prompts, tables))))
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        for _ in range(4):
            for i, seq in enumerate(seqs):
                ref = hf(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(out.logits[i], ref, atol=1e-4, rtol=1e-4)
            nxt = [int(out.logits[i].argmax()) for i in range(len(seqs))]
            rows = []
            for i, seq in enumerate(seqs):
                seq.append(nxt[i])
                rows.append(RowInput((nxt[i],), len(seq) - 1, tables[i], True))
            out = worker.execute(StepInput(tuple(rows)))


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_chunked_prefill_over_cached_prefix_matches(tmp_path: Path, attention: str) -> None:
    torch.manual_seed(1)
    hf = _make(tmp_path, "llama")
    worker = _worker(tmp_path, 16, attention)
    prompt = list(range(10, 30))
    table = (1, 2, 3, 4, 5)
    worker.execute(StepInput((RowInput(tuple(prompt[:9]), 0, table, False),)))
    out = worker.execute(StepInput((RowInput(tuple(prompt[9:]), 9, table, True, True),)))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(out.logits[0], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.all_logits[0], ref[9:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_step_mixing_decode_and_prefill_rows_matches(tmp_path: Path, attention: str) -> None:
    # continuous batching: one row decodes while another prefills (from scratch, and a chunk
    # over its cached prefix) in the same step
    torch.manual_seed(2)
    hf = _make(tmp_path, "llama")
    worker = _worker(tmp_path, 32, attention)
    a, b, c = [5, 17, 42, 7, 99, 3], list(range(40, 61)), [8, 1, 250, 33, 2, 77, 9]
    ta, tb, tc = (2, 11), (7, 3, 14, 20, 9, 16), (25, 5)
    first = worker.execute(StepInput((RowInput(tuple(a), 0, ta, True),
                                      RowInput(tuple(b[:10]), 0, tb, False))))
    a.append(int(first.logits[0].argmax()))
    out = worker.execute(StepInput((RowInput((a[-1],), len(a) - 1, ta, True),
                                    RowInput(tuple(b[10:]), 10, tb, True),
                                    RowInput(tuple(c), 0, tc, True))))
    with torch.no_grad():
        for i, seq in enumerate((a, b, c)):
            ref = hf(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(out.logits[i], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_a_bf16_cache_under_float32_compute_stays_near_transformers(tmp_path: Path,
                                                                   attention: str) -> None:
    """--kv-cache-dtype bfloat16 beside float32 compute: keys and values rounded to bf16 as
    they are stored; the logits stay transformers' float32 ones to bf16's precision, and a
    prompt gives the same logits in one step as in chunks over its cached prefix."""
    torch.manual_seed(3)
    hf = _make(tmp_path, "llama")
    worker = _worker(tmp_path, 32, attention, kv_cache_dtype="bfloat16")
    assert worker.runner.kv_cache.dtype == torch.bfloat16
    prompt = list(range(10, 30))
    whole = worker.execute(StepInput((RowInput(tuple(prompt), 0, (1, 2, 3, 4, 5), True),)))
    worker.execute(StepInput((RowInput(tuple(prompt[:9]), 0, (6, 7, 8, 9, 10), False),)))
    chunked = worker.execute(StepInput((RowInput(tuple(prompt[9:]), 9, (6, 7, 8, 9, 10), True),)))
    # (to float32's sums: torch's matmuls over the float32 weights round by the rows' count)
    torch.testing.assert_close(whole.logits, chunked.logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    err = (whole.logits[0] - ref).abs().max()
    assert 0 < err <= 0.01 * ref.abs().max(), err  # rounded (not float32's bits), and close
    assert int(whole.logits[0].argmax()) == int(ref.argmax())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the q/k/v biases
def test_bfloat16_decode_matches_transformers(tmp_path: Path, arch: str) -> None:
    """In bf16 on CPUs the native kernels (linear, norms, rope, attention) replace torch's: the
    logits stay those of transformers in bf16, to bf16's precision."""
    torch.manual_seed(2)
    hf = _make(tmp_path, arch).to(torch.bfloat16)
    worker = ShardWorker(WorkerConfig(str(tmp_path), "bfloat16", num_blocks=64, block_size=BLOCK))
    # on a CPU with AVX512-BF16 every linear (and the head) multiplies packed weights
    packed = worker.runner.model.lm_head.weight.dim() == 4
    assert packed is (worker.device.type == "cpu" and PACKS)
    seq = [5, 17, 42, 7, 99, 3, 11]
    table = (3, 9, 12, 5)
    out = worker.execute(StepInput((RowInput(tuple(seq), 0, table, True),)))
    with torch.no_grad():
        for _ in range(4):
            ref = hf(torch.tensor([seq])).logits[0, -1].float()
            got = out.logits[0].float()
            scale = ref.abs().max()
            # measured: under 0.5% of the largest logit
            assert (got - ref).abs().max() <= 0.02 * scale, (got - ref).abs().max()
            seq.append(int(ref.argmax()))
            out = worker.execute(StepInput((RowInput((seq[-1],), len(seq) - 1, table, True),)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="workers pick a GPU")
@pytest.mark.parametrize("dtype,kv", [("bfloat16", None), ("float32", None),
                                      ("float32", "bfloat16")])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_layers_match_the_python_layers_bit_for_bit(tmp_path: Path, arch: str,
                                                           dtype: str, kv: str | None) -> None:
    """On CPUs every decoder layer in one native call (llama_layers.c) runs the Python layers'
    kernels in their order, so the logits are the same to the bit, over steps mixing fresh
    prefill, a chunk over a cached prefix and decode: in bf16 over AVX512-BF16 packing, and in
    float32 over a bf16 checkpoint's weights kept as bf16 (every build), its cache float32 or
    bf16."""
    if dtype == "bfloat16" and not PACKS:
        pytest.skip("bf16 layers run natively on CPUs with AVX512-BF16")
    if kernels.load() is None:
        pytest.skip("no native kernels here")
    torch.manual_seed(4)
    hf = _make(tmp_path, arch)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)  # a bf16 checkpoint
    workers = [ShardWorker(WorkerConfig(str(tmp_path), dtype, num_blocks=32, block_size=BLOCK,
                                        kv_cache_dtype=kv)) for _ in range(2)]
    workers[1].runner.model._native_layers = lambda kv_cache, meta: None  # the Python layers
    a, b = [5, 17, 42, 7, 99, 3], list(range(40, 61))
    ta, tb = (2, 11), (7, 3, 14, 20, 9, 16)
    steps = [StepInput((RowInput(tuple(a), 0, ta, True), RowInput(tuple(b[:10]), 0, tb, False))),
             StepInput((RowInput((9,), len(a), ta, True), RowInput(tuple(b[10:]), 10, tb, True))),
             StepInput((RowInput((4,), len(a) + 1, ta, True), RowInput((8,), len(b), tb, True)))]
    for step in steps:
        native, python = (w.execute(step) for w in workers)
        assert torch.equal(native.logits, python.logits)
    assert workers[0].runner.model._native_table[1] is not None  # the native layers ran
