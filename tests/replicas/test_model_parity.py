"""Our Llama-family code on the paged cache gives transformers' logits on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from replicas.model_runner import RowInput, StepInput
from replicas.worker import ShardWorker, WorkerConfig

BLOCK = 4


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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_paged_decode_match_transformers(tmp_path: Path, arch: str) -> None:
    torch.manual_seed(0)
    hf = _make(tmp_path, arch)
    worker = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=64, block_size=BLOCK))
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


def test_chunked_prefill_over_cached_prefix_matches(tmp_path: Path) -> None:
    torch.manual_seed(1)
    hf = _make(tmp_path, "llama")
    worker = ShardWorker(WorkerConfig(str(tmp_path), "float32", num_blocks=16, block_size=BLOCK))
    prompt = list(range(10, 30))
    table = (1, 2, 3, 4, 5)
    worker.execute(StepInput((RowInput(tuple(prompt[:9]), 0, table, False),)))
    out = worker.execute(StepInput((RowInput(tuple(prompt[9:]), 9, table, True, True),)))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(out.logits[0], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.all_logits[0], ref[9:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the q/k/v biases
def test_bfloat16_decode_matches_transformers(tmp_path: Path, arch: str) -> None:
    """In bf16 on CPUs the native kernels (linear, norms, rope, attention) replace torch's: the
    logits stay those of transformers in bf16, to bf16's precision."""
    torch.manual_seed(2)
    hf = _make(tmp_path, arch).to(torch.bfloat16)
    worker = ShardWorker(WorkerConfig(str(tmp_path), "bfloat16", num_blocks=64, block_size=BLOCK))
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
