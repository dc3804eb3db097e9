"""Fixtures: the shipped tokenizer when present (else a throwaway byte-level BPE trained here), a
sentencepiece-style byte-fallback tokenizer, their vocabularies, and compilers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from structured.compiler import Compiler
from structured.vocabulary import Vocabulary
from tests.structured.structured_testing import (
    PADDED,
    SHIPPED_TOKENIZER,
    byte_fallback_tokenizer,
    train_byte_level,
)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    if SHIPPED_TOKENIZER.exists():
        return Tokenizer.from_file(str(SHIPPED_TOKENIZER))
    return train_byte_level()


@pytest.fixture(scope="session")
def vocab(tokenizer: Tokenizer) -> Vocabulary:
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    return Vocabulary.from_tokenizer(tokenizer, eos, tokenizer.get_vocab_size() + PADDED)


@pytest.fixture(scope="session")
def fallback_tokenizer() -> Tokenizer:
    return byte_fallback_tokenizer()


@pytest.fixture(scope="session")
def fallback_vocab(fallback_tokenizer: Tokenizer) -> Vocabulary:
    return Vocabulary.from_tokenizer(fallback_tokenizer, fallback_tokenizer.token_to_id("</s>"))


@pytest.fixture(scope="session")
def compiler(vocab: Vocabulary):
    c = Compiler(vocab, timeout_s=30.0, processes=1)
    yield c
    c.close()


@pytest.fixture(scope="session")
def fallback_compiler(fallback_vocab: Vocabulary):
    c = Compiler(fallback_vocab, timeout_s=30.0, processes=1)
    yield c
    c.close()


