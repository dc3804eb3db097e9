"""Converts a model to GGUF with llama.cpp's own `convert_hf_to_gguf.py`, for the `llama-server`
peer of `bench compare`:

    python -m benchmarks.to_gguf --llama-cpp DIR --model shardserve/bench-135m --out m.gguf

DIR is a llama.cpp source tree (e.g. `vendor/llama.cpp` of the `llama-cpp-python` sdist, where
`cmake -B build && cmake --build build --target llama-server` builds the server). Our embedded
models use a byte-level BPE tokenizer whose pre-tokenizer llama.cpp has no fingerprint for, and
the converter tries sentencepiece first: both are steered here (GPT-2's pre-tokenizer, no
sentencepiece), so the converter runs unmodified on the weights. Tokenization only shapes the
prompts; the benchmark fixes output lengths with ignore_eos."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.to_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    p.add_argument("--model", default="shardserve/bench-135m", help="model id or HF folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--outtype", default="bf16", help="f32, f16, bf16, q8_0")
    args = p.parse_args(argv)

    from replicas.model_files import resolve_model_path

    model = resolve_model_path(args.model)
    out = args.out.resolve()
    tree = args.llama_cpp.resolve()
    sys.path[:0] = [str(tree / "gguf-py"), str(tree)]
    os.chdir(tree)
    import conversion.base as base  # llama.cpp's converter package

    def no_sentencepiece(self: object, *_: object, **__: object) -> None:
        raise FileNotFoundError("no sentencepiece model: use tokenizer.json")

    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out),
                "--outtype", args.outtype]
    runpy.run_path(str(tree / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
