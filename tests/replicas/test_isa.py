"""Every ISA build of the native kernels this CPU can run (forced with SHARDSERVE_ISA, one
process each) gives transformers' logits, and the portable build's, for prefill, decode and
mixed steps; `--dtype auto` computes in what the CPU does fast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from replicas import kernels
from replicas.engine_core import resolve_dtype, resolve_kv_cache_dtype
from replicas.kernels import isa
from tests.replicas import isa_steps

ROOT = Path(__file__).resolve().parents[2]


def test_levels_follow_the_cpu_flags() -> None:
    v3 = frozenset("avx avx2 fma f16c bmi1 bmi2 movbe abm sse2".split())
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert isa.levels(v3, "x86_64") == ("avx2", "portable")
    assert isa.levels(v4, "x86_64") == ("avx512", "avx2", "portable")
    assert isa.levels(v4 | {"avx512_bf16", "avx512_vnni"}, "x86_64")[0] == "avx512_bf16"
    assert isa.levels(v4 | {"avx512_bf16"}, "x86_64")[0] == "avx512"  # no VNNI: not that build
    spr = v4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}
    assert isa.levels(spr, "x86_64")[:2] == ("amx_bf16", "avx512_bf16")
    assert isa.levels(spr - {"amx_tile"}, "x86_64")[0] == "avx512_bf16"
    assert isa.levels(frozenset({"avx2"}), "x86_64") == ("portable",)  # no FMA: not v3
    assert isa.levels(frozenset({"asimd", "sve", "bf16"}), "aarch64") == ("sve", "neon",
                                                                           "portable")
    assert isa.levels(frozenset({"asimd"}), "aarch64") == ("neon", "portable")
    assert isa.compute_dtype("avx512_bf16") == isa.compute_dtype("amx_bf16") == torch.bfloat16
    assert isa.compute_dtype("avx2") == isa.compute_dtype("portable") == torch.float32


def test_forcing_a_level_the_cpu_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isa.ENV, "sse9")
    isa.selected.cache_clear()
    try:
        with pytest.raises(ValueError, match="expected one of"):
            isa.selected()
        missing = [level for level in isa.FLAGS if level not in isa.levels()]
        monkeypatch.setenv(isa.ENV, missing[0])
        isa.selected.cache_clear()
        with pytest.raises(ValueError, match="this CPU runs only"):
            isa.selected()
        monkeypatch.setenv(isa.ENV, "portable")
        isa.selected.cache_clear()
        assert isa.selected() == "portable"
    finally:
        monkeypatch.delenv(isa.ENV)
        isa.selected.cache_clear()


# each x86 level's flag that the next level down lacks
_OWN_FLAG = {"amx_bf16": "-mamx-tile", "avx512_bf16": "-mavx512bf16",
             "avx512": "-march=x86-64-v4", "avx2": "-march=x86-64-v3"}


@pytest.mark.skipif(len(isa.levels()) < 2 or isa.levels()[0] not in _OWN_FLAG,
                    reason="one level only, or not x86")
def test_a_level_the_compiler_cannot_build_falls_back_to_the_next(tmp_path: Path) -> None:
    """A compiler older than the CPU (GCC before 11 knows no AMX flags) builds the next level
    down instead of leaving the process on torch's paths."""
    best, second = isa.levels()[:2]
    cc = tmp_path / "old-cc"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{_OWN_FLAG[best]}" ] && '
                  f'{{ echo "unrecognized option $a" >&2; exit 1; }}; done\nexec cc "$@"\n')
    cc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != isa.ENV}
    env.update(CC=str(cc), SHARDSERVE_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    code = ("from replicas import kernels; from replicas.kernels import isa; "
            "print(kernels.load() is not None, isa.selected())")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.split() == ["True", second], run.stderr
    assert f"cannot build the {best} kernels" in run.stderr


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16"])
def test_auto_dtype_is_what_the_cpu_computes_fast(checkpoint: str) -> None:
    config = transformers.LlamaConfig(dtype=checkpoint)
    on_cpu = resolve_dtype("auto", config, on_gpu=False)
    assert on_cpu == ("float32" if checkpoint == "float32"
                      else str(isa.compute_dtype()).removeprefix("torch."))
    assert resolve_dtype("auto", config, on_gpu=True) == checkpoint
    assert resolve_dtype("bfloat16", config, on_gpu=False) == "bfloat16"


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16"])
def test_auto_kv_cache_keeps_a_16_bit_checkpoints_precision_under_float32(checkpoint: str) -> None:
    """--kv-cache-dtype auto: the compute dtype, but bf16 where --dtype auto computes a 16-bit
    (or quantized) checkpoint in float32 on a CPU; explicit mixes other than that one fail."""
    config = transformers.LlamaConfig(dtype=checkpoint)
    widened = checkpoint != "float32" and kernels.load() is not None
    assert resolve_kv_cache_dtype("auto", "float32", config, on_gpu=False) == (
        "bfloat16" if widened else "float32")
    assert resolve_kv_cache_dtype("auto", "float32", config, on_gpu=False,
                                  dtype_auto=False) == "float32"  # --dtype float32 asked for
    assert resolve_kv_cache_dtype("auto", "bfloat16", config, on_gpu=False) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", checkpoint, config, on_gpu=True) == checkpoint
    assert resolve_kv_cache_dtype("bfloat16", "float32", config, on_gpu=False) == "bfloat16"
    for kv, dtype, gpu in (("float32", "bfloat16", False), ("float16", "float32", False),
                           ("bfloat16", "float32", True)):
        with pytest.raises(ValueError, match="--kv-cache-dtype"):
            resolve_kv_cache_dtype(kv, dtype, config, on_gpu=gpu)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A Llama saved in bf16 (as most published checkpoints are), and transformers' float32 model
    over the same bf16 values."""
    folder = tmp_path_factory.mktemp("bf16-llama")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder, model.float().eval()


def _run(folder: Path, dtype: str, level: str, out: Path) -> dict:
    env = {**os.environ, isa.ENV: level, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "tests.replicas.isa_steps", str(folder), dtype,
                    str(out)], env=env, cwd=ROOT, check=True, timeout=300, capture_output=True)
    return torch.load(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="workers pick the GPU")
@pytest.mark.parametrize("level", list(isa.FLAGS))
def test_every_level_gives_transformers_logits(level: str, bf16_checkpoint: tuple,
                                               tmp_path: Path) -> None:
    if level not in isa.levels():
        pytest.skip(f"this CPU does not run {level}")
    folder, hf = bf16_checkpoint
    # float32 compute: the bf16 weights stay bf16, widened by linear_mixed on every level
    got = _run(folder, "float32", level, tmp_path / "f32.pt")
    assert got["isa"] == level and got["head_packed"] == 3
    assert got["native_layers"]  # the decode step ran every layer in one native call
    with torch.no_grad():
        for sequences, logits in got["steps"]:
            for seq, row in zip(sequences, logits):
                ref = hf(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)
    if level != "portable":
        portable = _run(folder, "float32", "portable", tmp_path / "portable.pt")
        for (seqs, logits), (p_seqs, p_logits) in zip(got["steps"], portable["steps"]):
            assert seqs == p_seqs
            torch.testing.assert_close(logits, p_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="workers pick the GPU")
@pytest.mark.parametrize("level", ["amx_bf16", "avx512_bf16"])
def test_bf16_levels_give_transformers_logits(level: str, bf16_checkpoint: tuple,
                                              tmp_path: Path) -> None:
    """bf16 compute multiplies on AMX's tiles or with vdpbf16ps over the same packed weights
    (linear.c): both give transformers' logits to bf16's precision, prefill, decode and mixed."""
    if level not in isa.levels():
        pytest.skip(f"this CPU does not run {level}")
    folder, hf = bf16_checkpoint
    got = _run(folder, "bfloat16", level, tmp_path / "bf16.pt")
    assert got["isa"] == level and got["head_packed"] == 4 and got["native_layers"]
    with torch.no_grad():
        for sequences, logits in got["steps"]:
            for seq, row in zip(sequences, logits):
                ref = hf(torch.tensor([seq])).logits[0, -1]
                # bf16 activations rounded at every layer: within 2% of the largest logit
                assert (row - ref).abs().max() <= 0.02 * ref.abs().max(), (row - ref).abs().max()
