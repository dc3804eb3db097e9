"""Test helpers for structured/: tokenizers to build, and feeding text through a guide token by
token, checking every token against the mask (what an engine does)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from structured import bitmask
from structured.compiler import Compiled
from structured.guide import Guide
from structured.spec import Constraint

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "replicas" / "embedded" / "tokenizer.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PADDED = 61  # logits wider than the tokenizer, and not a multiple of 32


def _sample_text() -> list[str]:
    words = ["the", "quick", "brown", "fox", "json", "name", "value", "true", "false", "null",
             "日本", "語", "😀", "données", "café", "{", "}", "[", "]", ":", ",", '"', "-", "."]
    rng = random.Random(0)
    lines = []
    for _ in range(2000):
        lines.append(" ".join(rng.choice(words) for _ in range(10)))
        lines.append(json.dumps({"name": rng.choice(words), "value": rng.randint(-999, 999),
                                 "ok": True, "list": [1, 2.5, None]}, ensure_ascii=False))
    return lines


def train_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_sample_text(), trainer)
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # non-special added tokens are text
    return tok


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2 style: `▁` for spaces, `<0xNN>` tokens for bytes no piece covers."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]:,.\"-_é▁")
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("n", "a"), ("m", "e"), ("na", "me"),
              ("\"", "na"), ("\"na", "me")]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of text as a model would write it (without the sentencepiece prefix space)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    if ids and not text.startswith(" ") and tok.id_to_token(ids[0]) == "▁":
        ids = ids[1:]
    return ids


def allowed(mask_row, token_id: int) -> bool:
    return bool((int(mask_row[token_id >> 5]) >> (token_id & 31)) & 1)


def feed(guide: Guide, token_ids: list[int]) -> bool:
    """True when every token is allowed by the mask in turn and the output is then complete (EOS
    allowed by the mask too)."""
    mask = bitmask.allocate(3, guide.vocab.size)
    for t in token_ids:
        guide.fill_bitmask(mask, 1)
        if not allowed(mask[1], t):
            return False
        guide.advance(t)
    guide.fill_bitmask(mask, 1)
    return guide.is_finished() and allowed(mask[1], guide.vocab.eos_token_id)


def accepts(compiled: Compiled, tok: Tokenizer, text: str) -> bool:
    return feed(compiled.new_guide(), encode(tok, text))


def schema(s: dict, **kw) -> Constraint:
    return Constraint("json_schema", json.dumps(s), **kw)
