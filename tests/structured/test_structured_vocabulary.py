"""The vocabulary is keyed by bytes: tokens that split a UTF-8 character still mean their bytes, so
"日本" and emoji can be produced under a constraint, for byte-level and byte-fallback tokenizers."""

from __future__ import annotations

import json

import outlines_core
import pytest

from structured.spec import Constraint
from structured.vocabulary import Vocabulary
from tests.structured.structured_testing import accepts, encode, feed

TEXT = "日本 😀 café"


def test_byte_level_tokens_are_bytes(tokenizer, vocab):
    ids = encode(tokenizer, TEXT)
    assert b"".join(vocab.token_bytes[i] for i in ids) == TEXT.encode()
    partial = [b for b in vocab.token_bytes if b]
    undecodable = 0
    for b in partial:
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            undecodable += 1
    assert undecodable > 0  # tokens holding part of a character exist and are kept as bytes


def test_specials_excluded_eos_kept_added_text_kept(tokenizer, vocab):
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert vocab.token_bytes[im_start] is None
    assert vocab.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),
                                   tokenizer.token_to_id("<|endoftext|>"))
    assert all(vocab.token_bytes[e] is None for e in vocab.eos_token_ids)
    tool_call = tokenizer.token_to_id("<tool_call>")
    assert vocab.token_bytes[tool_call] == b"<tool_call>"
    assert vocab.size > len(vocab.token_bytes) and vocab.bitmask_words == (vocab.size + 31) // 32


def test_byte_fallback_tokens(fallback_tokenizer, fallback_vocab):
    ids = encode(fallback_tokenizer, "the 日本")
    pieces = [fallback_vocab.token_bytes[i] for i in ids]
    assert b"\xe6" in pieces  # <0xE6>: a byte, not the text "<0xE6>"
    assert pieces[0] == b" the"  # ▁ is a space
    assert b"".join(pieces) == " the 日本".encode()
    assert fallback_vocab.token_bytes[fallback_tokenizer.token_to_id("<s>")] is None


def test_llguidance_agrees_on_every_token(vocab):
    ll = vocab.llguidance
    for i, b in enumerate(vocab.token_bytes):
        # 0xFF marks special tokens in llguidance; it never occurs in UTF-8 text, so a byte-level
        # token starting with it can never be allowed by either backend anyway.
        if b is not None and not b.startswith(b"\xff"):
            assert ll.decode_bytes([i]) == b, i
    assert ll.vocab_size == vocab.size


def test_outlines_vocabulary_takes_bytes_keys(vocab):
    assert isinstance(vocab.outlines, outlines_core.Vocabulary)
    assert vocab.outlines.get_eos_token_id() == vocab.eos_token_id


def test_from_path_and_text_agree(tokenizer, tmp_path, vocab):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    by_path = Vocabulary.from_tokenizer(path, list(vocab.eos_token_ids), vocab.size)
    assert by_path.token_bytes == vocab.token_bytes


def test_logits_narrower_than_the_tokenizer(tokenizer, vocab):
    narrow = Vocabulary.from_tokenizer(tokenizer, list(vocab.eos_token_ids), vocab.eos_token_id + 1)
    assert len(narrow.token_bytes) == narrow.size == vocab.eos_token_id + 1


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        Vocabulary.from_tokenizer('{"model": {"type": "BPE", "vocab": {"a": 0}}}', [])
    with pytest.raises(ValueError):
        Vocabulary.from_tokenizer('{"model": {"type": "BPE", "vocab": {"a": 0}}}', 5)


@pytest.mark.parametrize("which", ["byte_level", "byte_fallback"])
async def test_unicode_through_regex_and_json(which, request):
    tok = request.getfixturevalue("tokenizer" if which == "byte_level" else "fallback_tokenizer")
    compiler = request.getfixturevalue("compiler" if which == "byte_level" else "fallback_compiler")
    anything = await compiler.compile(Constraint("regex", r"(.|\n)*"))
    assert accepts(anything, tok, "日本😀")
    string = await compiler.compile(Constraint("json_schema", json.dumps({"type": "string"})))
    assert accepts(string, tok, json.dumps("日本😀", ensure_ascii=False))


async def test_padded_ids_never_allowed(compiler, vocab):
    from structured import bitmask

    compiled = await compiler.compile(Constraint("regex", r"(.|\n)*"))
    for guide in (compiled.new_guide(),
                  (await compiler.compile(Constraint("json_object", ""))).new_guide()):
        mask = bitmask.allocate(1, vocab.size)
        guide.fill_bitmask(mask, 0)
        for i in range(len(vocab.token_bytes), vocab.size):
            assert not (int(mask[0, i >> 5]) >> (i & 31)) & 1
    assert feed(compiled.new_guide(), [])


def test_pickles_without_backend_objects(vocab):
    import pickle

    vocab.llguidance  # noqa: B018 (build the cached backend objects first)
    vocab.outlines  # noqa: B018
    copy = pickle.loads(pickle.dumps(vocab))
    assert copy.token_bytes == vocab.token_bytes and copy.eos_token_ids == vocab.eos_token_ids
    assert copy.llguidance.vocab_size == vocab.size


def test_structured_never_imports_replicas():
    import ast
    from pathlib import Path

    import structured

    for path in Path(structured.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "replicas" or n.startswith("replicas.") for n in names), path
