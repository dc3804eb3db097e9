"""Request generators: lengths, shared prefixes, determinism, ShareGPT parsing, structured mix."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.datasets import (
    count_tokens,
    load_tokenizer,
    parse_structured_mix,
    random_mm_requests,
    random_requests,
    sharegpt_requests,
    structured_requests,
)


class MergingTokenizer:
    """Greedy longest-match over {a, b, ab, ba, aba}: decode/encode does not round-trip token
    counts, which is what the length fitting has to cope with."""

    vocab = ["<eos>", "a", "b", "ab", "ba", "aba"]
    all_special_ids = [0]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for size in (3, 2, 1):
                piece = text[i : i + size]
                if len(piece) == size and piece in self.vocab[1:]:
                    ids.append(self.vocab.index(piece))
                    i += size
                    break
            else:
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


def test_random_words_lengths_and_shared_prefix() -> None:
    reqs = random_requests(200, input_len=100, output_len=20, range_ratio=0.5, prefix_len=8, seed=3)
    assert len(reqs) == 200
    prefixes = {" ".join(r.prompt.split()[:8]) for r in reqs}
    assert len(prefixes) == 1
    for r in reqs:
        assert 8 + 50 <= r.prompt_len <= 8 + 150
        assert len(r.prompt.split()) == r.prompt_len  # one word per estimated token
        assert 10 <= r.output_len <= 30
        assert r.fixed_output and r.kind == "random"
    # The range is actually used, not just its midpoint.
    assert len({r.output_len for r in reqs}) > 5


def test_random_zero_ratio_gives_exact_lengths() -> None:
    reqs = random_requests(10, input_len=32, output_len=7, seed=0)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(32, 7)}


def test_random_is_deterministic_per_seed() -> None:
    a = random_requests(5, 20, 5, 0.3, 4, seed=11)
    assert a == random_requests(5, 20, 5, 0.3, 4, seed=11)
    assert [r.prompt for r in a] != [r.prompt for r in random_requests(5, 20, 5, 0.3, 4, seed=12)]


def test_random_rejects_bad_arguments() -> None:
    for kwargs in ({"range_ratio": 1.0}, {"range_ratio": -0.1}, {"output_len": 0}, {"input_len": -1}):
        args = {"num_requests": 2, "input_len": 10, "output_len": 5} | kwargs
        with pytest.raises(ValueError):
            random_requests(**args)


def test_random_with_tokenizer_fits_lengths_despite_merges() -> None:
    tok = MergingTokenizer()
    reqs = random_requests(30, input_len=40, output_len=5, range_ratio=0.2, prefix_len=10, tokenizer=tok, seed=5)
    prefix = tok.decode(tok.encode(reqs[0].prompt)[:10])
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert abs(r.prompt_len - 50) <= 10
    # Every prompt starts with the same shared prefix text.
    shared = reqs[0].prompt
    for r in reqs[1:]:
        shared = shared[
            : next((i for i, (x, y) in enumerate(zip(shared, r.prompt)) if x != y), min(len(shared), len(r.prompt)))
        ]
    assert len(shared) >= len(prefix) - 2


def test_random_with_hf_tokenizer_from_path(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]"] + [f"w{i}" for i in range(100)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(tmp_path)

    tok = load_tokenizer(str(tmp_path))
    reqs = random_requests(5, input_len=24, output_len=3, prefix_len=6, tokenizer=tok, seed=0)
    for r in reqs:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len == 30
        assert not set(ids) & set(tok.all_special_ids)
    assert len({tuple(tok.encode(r.prompt, add_special_tokens=False)[:6]) for r in reqs}) == 1


def _write_sharegpt(path: Path) -> None:
    data = [
        {
            "id": "1",
            "conversations": [{"from": "human", "value": "word " * 20}, {"from": "gpt", "value": "reply " * 40}],
        },
        {
            "id": "2",
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "hello there " * 10},
                {"from": "gpt", "value": "x" * 80},
            ],
        },
        {
            "id": "3",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long enough answer here"}],
        },  # prompt too short
        {"id": "4", "conversations": [{"from": "human", "value": "only a question with no answer"}]},
        {
            "id": "5",
            "messages": [
                {"role": "user", "content": "message form prompt " * 5},
                {"role": "assistant", "content": "ok " * 30},
            ],
        },
    ]
    path.write_text(json.dumps(data))


def test_sharegpt_first_exchange_and_filters(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    reqs = sharegpt_requests(path, num_requests=10, seed=0)
    assert len(reqs) == 3
    by_prompt = {r.prompt: r for r in reqs}
    assert ("word " * 20) in by_prompt
    assert by_prompt["word " * 20].output_len == count_tokens("reply " * 40, None)
    assert by_prompt["hello there " * 10].output_len == 20  # 80 chars at ~4 chars/token
    assert all(r.kind == "sharegpt" for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in sharegpt_requests(path, 10, seed=0)]
    assert len(sharegpt_requests(path, 2)) == 2


def test_sharegpt_output_len_override(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    reqs = sharegpt_requests(path, 10, output_len=17)
    assert len(reqs) == 4  # the short prompt is kept once lengths are overridden
    assert {r.output_len for r in reqs} == {17}


def test_sharegpt_rejects_non_list(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(ValueError):
        sharegpt_requests(path, 1)


def test_structured_mix_bodies_and_determinism() -> None:
    reqs = structured_requests(300, output_len=64, mix={"json_schema": 2, "regex": 1, "choice": 1}, seed=4)
    kinds = Counter(r.kind for r in reqs)
    assert set(kinds) == {"structured:json_schema", "structured:regex", "structured:choice"}
    assert kinds["structured:json_schema"] > kinds["structured:regex"]
    for r in reqs:
        assert r.output_len == 64 and not r.fixed_output
        if r.kind == "structured:json_schema":
            fmt = r.extra_body["response_format"]
            assert fmt["type"] == "json_schema" and "schema" in fmt["json_schema"]
        elif r.kind == "structured:regex":
            assert isinstance(r.extra_body["structured_outputs"]["regex"], str)
        else:
            assert r.extra_body["structured_outputs"]["choice"] == ["positive", "negative", "neutral"]
    assert reqs == structured_requests(300, 64, {"json_schema": 2, "regex": 1, "choice": 1}, seed=4)


def test_structured_mix_parsing() -> None:
    assert parse_structured_mix("json_schema=2, regex=0.5,choice") == {"json_schema": 2.0, "regex": 0.5, "choice": 1.0}
    for bad in ("grammar=1", "regex=x", "regex=0", "regex=-1"):
        with pytest.raises(ValueError):
            parse_structured_mix(bad)
    assert {r.kind for r in structured_requests(20, mix=parse_structured_mix("choice=1"))} == {"structured:choice"}


def test_random_mm_images_are_new_or_drawn_from_a_pool() -> None:
    fresh = random_mm_requests(3, 8, 4, image_size=(20, 10), images_per_request=2)
    urls = [p["image_url"]["url"] for r in fresh for p in r.chat_messages()[0]["content"]
            if p["type"] == "image_url"]
    assert len(urls) == 6 and len(set(urls)) == 6
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    assert fresh[0].chat_messages()[0]["content"][-1] == {"type": "text",
                                                          "text": fresh[0].prompt}
    pooled = random_mm_requests(4, 8, 4, image_size=(20, 10), distinct_images=2)
    urls = [r.chat_messages()[0]["content"][0]["image_url"]["url"] for r in pooled]
    assert urls[0] == urls[2] and urls[1] == urls[3] and urls[0] != urls[1]
    with pytest.raises(ValueError):
        random_mm_requests(1, 8, 4, images_per_request=0)
