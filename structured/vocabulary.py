"""The token vocabulary as bytes, built once per tokenizer, in the forms both backends need.

Constraints are matched on bytes, never on decoded strings: a byte-level BPE token may hold half of
a UTF-8 character ("日" is three bytes and often two tokens), and a string-keyed vocabulary turns
such tokens into U+FFFD, so valid text like "日本" could never be produced.

Supported tokenizer families (read from the `tokenizers` JSON):
  byte-level BPE (GPT-2, Llama 3, Qwen): token characters map back to bytes through GPT-2's
    byte-to-unicode table;
  sentencepiece style (Llama 2, Mistral, Gemma): `<0xNN>` byte-fallback tokens are the byte NN and
    `▁` is a space;
  anything else: the token text as UTF-8.
Added tokens are literal text unless marked special; special tokens are not text and never match a
constraint, except the EOS ids, which end the output.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance
    import outlines_core
    import tokenizers

# The noncharacter U+10FFFF ends every outlines-core regex (see structured/guide.py). Its lead byte
# 0xF4 only starts the private-use plane 16, so tokens holding it are left out of outlines-core's
# vocabulary: then no text the model writes can spell the sentinel.
OUTLINES_SENTINEL = "\U0010FFFF".encode("utf-8")
_SENTINEL_LEAD = OUTLINES_SENTINEL[:1]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"  # ▁


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _walk_types(node: Any) -> set[str]:
    """Every `"type"` value inside a tokenizer component (decoders nest in Sequences)."""
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for value in node.values():
            found |= _walk_types(value)
    elif isinstance(node, list):
        for value in node:
            found |= _walk_types(value)
    return found


def token_to_bytes(token: str, byte_level: bool, byte_fallback: bool, spiece: bool) -> bytes:
    """The bytes a vocabulary entry stands for (GPT-2 byte-level, `<0xNN>`, or `▁` spaces)."""
    if byte_level:
        if all(c in _UNICODE_TO_BYTE for c in token):
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        return token.encode("utf-8")
    if byte_fallback:
        m = _BYTE_FALLBACK.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
    if spiece:
        token = token.replace(_SPIECE_SPACE, " ")
    return token.encode("utf-8")


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """Token id -> bytes for one tokenizer and one model.

    token_bytes[i] is the text token i stands for, or None when i is not text (special tokens other
    than EOS, padded logits rows). `size` is the model's logits width, which may exceed the
    tokenizer's size; ids in between are never allowed. Build it once per model and share it.
    """

    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]
    size: int
    tokenizer_json: str = field(repr=False)
    special_names: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: tokenizers.Tokenizer | str | os.PathLike[str],
                       eos_token_ids: int | Sequence[int], vocab_size: int | None = None,
                       ) -> Vocabulary:
        """Build from a `tokenizers.Tokenizer`, a tokenizer.json path, or tokenizer.json text.

        eos_token_ids: the ids that end the output (the first is the primary one).
        vocab_size: the logits width; defaults to the tokenizer's size. Ids past it are dropped.
        """
        if isinstance(tokenizer, (str, os.PathLike)):
            text = str(tokenizer)
            if not text.lstrip().startswith("{"):
                with open(text, encoding="utf-8") as f:
                    text = f.read()
        else:
            text = tokenizer.to_str()
        data = json.loads(text)
        eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        if not eos:
            raise ValueError("at least one EOS token id is needed")

        model = data.get("model") or {}
        decoder_types = _walk_types(data.get("decoder"))
        byte_level = ("ByteLevel" in decoder_types
                      or "ByteLevel" in _walk_types(data.get("pre_tokenizer")))
        byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in decoder_types
        spiece = byte_fallback or "Metaspace" in decoder_types or _SPIECE_SPACE in json.dumps(
            data.get("decoder"), ensure_ascii=False)

        vocab: dict[str, int] = dict(model.get("vocab") or {})
        if isinstance(model.get("vocab"), list):  # Unigram: [[piece, score], ...]
            vocab = {piece: i for i, (piece, _score) in enumerate(model["vocab"])}
        by_id: dict[int, bytes | None] = {
            i: token_to_bytes(tok, byte_level, byte_fallback, spiece) for tok, i in vocab.items()}
        special_names: dict[int, str] = {}
        for added in data.get("added_tokens") or []:
            if added.get("special"):
                by_id[added["id"]] = None
                special_names[added["id"]] = added["content"]
            else:
                by_id[added["id"]] = added["content"].encode("utf-8")

        size = max(by_id, default=-1) + 1 if vocab_size is None else vocab_size
        if any(not 0 <= e < size for e in eos):
            raise ValueError(f"EOS ids {eos} out of range for vocab_size {size}")
        # Tokens past the logits width (extra added tokens) can never be sampled: left out.
        n_tokens = min(size, max(by_id, default=-1) + 1)
        token_bytes = tuple(
            None if i in eos else (by_id.get(i) or None) for i in range(n_tokens))
        return cls(token_bytes=token_bytes, eos_token_ids=eos, size=size, tokenizer_json=text,
                   special_names=special_names)

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: ceil(size / 32)."""
        return (self.size + 31) // 32

    @property
    def outlines_sentinel_id(self) -> int:
        """The id of the sentinel token in `outlines` (see structured/guide.py): past every bitmask
        bit, so outlines-core never writes it into a mask row."""
        return self.bitmask_words * 32

    @cached_property
    def outlines(self) -> outlines_core.Vocabulary:
        """outlines-core's vocabulary: bytes keys, the primary EOS, the sentinel token, and no token
        holding byte 0xF4 (plane-16 private-use characters cannot be written under outlines-core
        constraints). Other EOS ids are added to masks by the guide."""
        import outlines_core

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            if b and _SENTINEL_LEAD not in b:
                by_bytes.setdefault(b, []).append(i)
        by_bytes[OUTLINES_SENTINEL] = [self.outlines_sentinel_id]
        return outlines_core.Vocabulary(self.eos_token_id, by_bytes)

    @cached_property
    def llguidance(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer over our token bytes, so both backends agree on what every token is
        (llguidance's own loader would make non-special added tokens like `<tool_call>` special and
        unusable as text). Sized to the logits width; special tokens are `\\xff<name>` as llguidance
        expects, padded ids empty. Text is encoded by llguidance's own loader of the tokenizer.json
        (used only to tokenize forced text for jump-forward), which knows how to skip the prefix
        space that sentencepiece-style normalizers add."""
        import llguidance

        try:
            encoder = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.size,
                                             eos_token=list(self.eos_token_ids))
            encode = encoder.tokenize_bytes
        except Exception:  # noqa: BLE001 (llguidance cannot load it: encode with `tokenizers`)
            tokenizer = self.tokenizer
            encode = lambda b: tokenizer.encode(
                b.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_LLGuidanceSource(self, encode)),
                                      n_vocab=self.size, eos_token=list(self.eos_token_ids))

    @cached_property
    def tokenizer(self) -> tokenizers.Tokenizer:
        import tokenizers

        return tokenizers.Tokenizer.from_str(self.tokenizer_json)

    def __getstate__(self) -> dict:
        # The backend objects are rebuilt on demand; LLTokenizer does not pickle.
        return {k: v for k, v in self.__dict__.items() if k not in ("outlines", "llguidance", "tokenizer")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


class _LLGuidanceSource:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, and an encoder of bytes."""

    def __init__(self, vocab: Vocabulary, encode: Callable[[bytes], list[int]]) -> None:
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = None
        self.tokens = [
            b if b is not None
            else b"\xff" + vocab.special_names.get(i, f"<[{i}]>").encode("utf-8")
            for i, b in enumerate(vocab.token_bytes)
        ] + [b""] * (vocab.size - len(vocab.token_bytes))
        self.special_token_ids = [i for i, b in enumerate(vocab.token_bytes) if b is None]
        self._encode = encode

    def __call__(self, text: bytes | str) -> list[int]:
        return self._encode(text.encode("utf-8") if isinstance(text, str) else text)
