"""The incremental detokenizer alone (no Ray), on the embedded model's byte-level BPE tokenizer:
pieces add up to the whole-sequence decode, multi-byte characters are never split, unfinished ones
are flushed, stop strings across token boundaries, and `spaces_between_special_tokens`."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from replicas.embedded import EMBEDDED_MODEL_ID
from replicas.model_files import resolve_model_path
from serve_app.detokenize import IncrementalDetokenizer

IM_START, IM_END, THINK = 3992, 3993, 3996
WORLD, HE = 3241, 264  # " world", "he"
EMOJI = [654, 246, 222]  # the four bytes of 😀 over three tokens


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_MODEL_ID))


@pytest.fixture(scope="module")
def fast(tokenizer):
    return tokenizer.backend_tokenizer


def one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    return "".join(detok.add([t]).text for t in ids) + detok.flush()


def test_token_ids_of_the_fixtures(tokenizer) -> None:
    assert tokenizer.convert_ids_to_tokens([IM_START, IM_END, THINK, WORLD, HE]) == [
        "<|im_start|>", "<|im_end|>", "<think>", "Ġworld", "he"]
    assert tokenizer.decode(EMOJI) == "😀"


@pytest.mark.parametrize("text", ["Hello world, this is a test.", "日本語のテキスト 😀 ok",
                                  "a\n\n  b\tc  ", "中文字符 and ascii"])
def test_pieces_add_up_to_the_whole_decode(tokenizer, fast, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = []
    detok = IncrementalDetokenizer(fast)
    for t in ids:
        piece = detok.add([t]).text
        assert "\ufffd" not in piece  # a multi-byte character is never emitted half-way
        pieces.append(piece)
    assert "".join(pieces) + detok.flush() == text == tokenizer.decode(ids)
    assert IncrementalDetokenizer(fast).add(ids).text == text


def test_emoji_waits_for_its_last_byte(fast) -> None:
    detok = IncrementalDetokenizer(fast)
    assert [detok.add([t]).text for t in EMOJI] == ["", "", "😀"]


def test_flush_releases_an_unfinished_character(tokenizer, fast) -> None:
    """Generation that ends inside a character shows its bytes as U+FFFD, like a full decode
    (they used to be dropped, so a response differed from /detokenize of its token_ids)."""
    ids = [HE, *EMOJI[:2]]
    detok = IncrementalDetokenizer(fast)
    assert detok.add(ids).text == "he"
    tail = detok.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert "he" + tail == tokenizer.decode(ids)
    assert detok.text == tokenizer.decode(ids)
    assert detok.flush() == ""  # only once


def test_stop_string_across_tokens_and_held_text(fast, tokenizer) -> None:
    ids = tokenizer.encode("hello world and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(fast, stop=["o wor"])
    out = [detok.add([t]) for t in ids]
    assert "".join(d.text for d in out) == "hell"
    assert [d.stop for d in out if d.stop] and out[-1].stop == "o wor"
    kept = IncrementalDetokenizer(fast, stop=["o wor"], include_stop_str_in_output=True)
    assert "".join(kept.add([t]).text for t in ids) == "hello wor"
    # a held prefix of a stop string that never completes is released by flush
    partial = IncrementalDetokenizer(fast, stop=["world peace"])
    text = "".join(partial.add([t]).text for t in tokenizer.encode("hello world",
                                                                   add_special_tokens=False))
    assert text.startswith("hello") and "world" not in text  # " world" may become the stop
    assert text + partial.flush() == "hello world"


SPECIAL_MIX = [WORLD, IM_END, IM_START, HE, THINK, HE]


@pytest.mark.parametrize("spaces, expected", [
    (True, " world <|im_end|> <|im_start|> he <think> he"),
    (False, " world<|im_end|><|im_start|>he<think>he"),
])
def test_spaces_between_special_tokens(fast, spaces: bool, expected: str) -> None:
    """vLLM: with skip_special_tokens off, added tokens are joined to the text around them (and
    to each other) with a space, unless spaces_between_special_tokens is false."""
    detok = IncrementalDetokenizer(fast, skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
    assert one_by_one(detok, SPECIAL_MIX) == expected
    whole = IncrementalDetokenizer(fast, skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
    assert whole.add(SPECIAL_MIX).text + whole.flush() == expected


def test_a_stop_string_ends_the_output_at_the_token_that_completed_it(fast, tokenizer) -> None:
    """Given many tokens at once (the replica groups them under load), the output's tokens end
    at the one that completed the stop string, whatever came after it."""
    ids = tokenizer.encode("hello world and more text after it", add_special_tokens=False)
    for stop, include in (("o wor", False), ("o wor", True), ("and", False)):
        d = IncrementalDetokenizer(fast, stop=[stop], include_stop_str_in_output=include)
        out = d.add(ids)
        # the fewest tokens whose text contains the stop string
        used = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
        assert out.stop == stop and out.used == used < len(ids)
        assert d.add(ids).used == 0  # nothing more after the stop
    assert IncrementalDetokenizer(fast, stop=["zzz"]).add(ids).used == len(ids)


def test_min_tokens_holds_stop_strings_back(fast, tokenizer) -> None:
    """As vLLM: a stop string counts only from the min_tokens-th output token on."""
    ids = tokenizer.encode("stop here, then stop again", add_special_tokens=False)
    early = IncrementalDetokenizer(fast, stop=["stop"]).add(ids)
    assert early.text == "" and early.used == 2  # "st", "op"
    held = IncrementalDetokenizer(fast, stop=["stop"], min_tokens=3)
    out = held.add(ids)
    assert out.stop == "stop" and out.text == "stop here, then "
    assert tokenizer.decode(ids[:out.used]).endswith("then stop")


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_flag_is_moot_when_special_tokens_are_skipped(fast, spaces: bool) -> None:
    detok = IncrementalDetokenizer(fast, skip_special_tokens=True,
                                   spaces_between_special_tokens=spaces)
    # special tokens vanish; <think> is an added but not special token: kept, never spaced
    assert one_by_one(detok, SPECIAL_MIX) == " worldhe<think>he"


def test_spaces_with_bytes_held_before_an_added_token(tokenizer, fast) -> None:
    ids = [HE, EMOJI[0], IM_END, HE]
    spaced = one_by_one(IncrementalDetokenizer(fast, skip_special_tokens=False), ids)
    plain = one_by_one(IncrementalDetokenizer(fast, skip_special_tokens=False,
                                              spaces_between_special_tokens=False), ids)
    assert plain == tokenizer.decode(ids, skip_special_tokens=False)
    assert spaced == plain.replace("<|im_end|>", " <|im_end|> ")
