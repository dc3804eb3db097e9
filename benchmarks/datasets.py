"""Request generators: turn a dataset choice into ``BenchRequest``s (prompt or messages,
expected output length, extra request body). Knows nothing of HTTP or timing.

- ``random_requests``: synthetic prompts of controlled token length, optionally sharing a prefix.
- ``sharegpt_requests``: first human turn of ShareGPT-style conversations; the reply sets the
  output length.
- ``structured_requests``: a seeded mix of json_schema / regex / choice constrained requests.
- ``random_mm_requests``: random prompts, each after images of a given size (data URLs of seeded
  noise), either all different (encoder and prefix caches miss) or drawn from a few (they hit).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``messages`` (chat form) is derived from ``prompt`` when absent.

    ``fixed_output`` says whether ``ignore_eos`` may force exactly ``output_len`` tokens;
    constrained requests must be allowed to stop when their grammar completes.
    """

    prompt: str
    prompt_len: int
    output_len: int
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    messages: tuple[Mapping[str, Any], ...] | None = None
    fixed_output: bool = True
    kind: str = ""

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the generators use."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def load_tokenizer(path: str) -> Tokenizer:
    """Load a Hugging Face tokenizer from a local path (the hub is not assumed reachable)."""
    # Imported here: transformers takes seconds to import and most commands never need it.
    from transformers import AutoTokenizer

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(path)  # type: ignore[assignment]
    return tokenizer


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    """Token count of ``text``; without a tokenizer, the common ~4 characters per token estimate."""
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return max(1, round(len(text) / 4))


# ---------------------------------------------------------------------------------------------
# random

# Short, common English words: each is about one token with a leading space in BPE vocabularies,
# so a prompt of N words is about N tokens when no tokenizer is given.
_WORDS: tuple[str, ...] = tuple(
    """the of and to in is was he for it with as his on be at by had are but from or have an
    they which one you were her all she there would their we him been has when who will more no
    if out so said what up its about into than them can only other new some could time these two
    may then do first any my now such like our over man me even most made after also did many
    before must through back years where much your way well down should because each just those
    people how too little state good very make world still own see men work long get here between
    both life being under never day same another know while last might us great old year off come
    since against go came right used take three house light water small place found sound number
    river cloud stone paper garden window music market bridge forest winter summer table letter
    """.split()
)


def _length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    return math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))


def _allowed_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    # Special tokens (BOS/EOS/pad, chat markers) would change how the server parses the prompt.
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer has no non-special tokens to build prompts from")
    return ids


def _fit_text(
    tokenizer: Tokenizer,
    head: str,
    ids: list[int],
    target: int,
    allowed: np.ndarray,
    rng: np.random.Generator,
    max_rounds: int = 10,
) -> tuple[str, int]:
    """Decode ``ids`` to text whose ``head + text`` re-encodes to ``target`` tokens.

    Decoding random ids and re-encoding rarely round-trips (tokens merge or split at boundaries),
    so trim or top up the ids a few rounds; returns the text and its actual total length.
    """
    text, total = "", 0
    for _ in range(max_rounds):
        text = tokenizer.decode(ids)
        total = len(tokenizer.encode(head + text, add_special_tokens=False))
        if total == target:
            break
        if total > target:
            ids = ids[: max(0, len(ids) - (total - target))]
        else:
            ids = ids + rng.choice(allowed, size=target - total).tolist()
    return text, total


def random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """Synthetic prompts of ``prefix_len + U[input_len*(1-r), input_len*(1+r)]`` tokens and output
    lengths ``U[output_len*(1-r), output_len*(1+r)]`` (at least 1), like vllm's random dataset.

    All requests share the same ``prefix_len``-token prefix (to exercise prefix caching); the rest
    is random so requests do not share cache. Built from random token ids of ``tokenizer`` or,
    without one, from random common words (lengths then approximate).
    """
    if num_requests < 0 or input_len < 0 or prefix_len < 0:
        raise ValueError("num_requests, input_len and prefix_len must be >= 0")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = _length_bounds(input_len, range_ratio)
    out_lo, out_hi = _length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(max(out_lo, 1), out_hi + 1, size=num_requests)

    requests: list[BenchRequest] = []
    if tokenizer is None:
        words = np.array(_WORDS)
        prefix = " ".join(rng.choice(words, size=prefix_len)) if prefix_len else ""
        for n_in, n_out in zip(input_lens, output_lens):
            body = " ".join(rng.choice(words, size=int(n_in)))
            prompt = f"{prefix} {body}" if prefix and body else prefix or body
            requests.append(BenchRequest(prompt, prefix_len + int(n_in), int(n_out), kind="random"))
        return requests

    allowed = _allowed_token_ids(tokenizer)
    prefix, _ = _fit_text(tokenizer, "", rng.choice(allowed, size=prefix_len).tolist(), prefix_len, allowed, rng)
    # Decoded text of non-byte-level tokenizers (WordPiece, SentencePiece) has no leading space,
    # so gluing prefix and body would merge their boundary tokens and break the shared prefix.
    if prefix and not prefix[-1].isspace():
        prefix += " "
    for n_in, n_out in zip(input_lens, output_lens):
        ids = rng.choice(allowed, size=int(n_in)).tolist()
        body, total = _fit_text(tokenizer, prefix, ids, prefix_len + int(n_in), allowed, rng)
        requests.append(BenchRequest(prefix + body, total, int(n_out), kind="random"))
    return requests


# ---------------------------------------------------------------------------------------------
# sharegpt

_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt", "bard", "bing"}


def _first_exchange(conversation: Mapping[str, Any]) -> tuple[str, str] | None:
    """(first human turn, the assistant reply after it), accepting ShareGPT's
    ``conversations/from/value`` and the ``messages/role/content`` form."""
    turns = conversation.get("conversations") or conversation.get("messages") or []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            return None
        speaker = str(turn.get("from", turn.get("role", ""))).lower()
        if speaker in _HUMAN:
            for reply in turns[i + 1 :]:
                if isinstance(reply, Mapping) and str(reply.get("from", reply.get("role", ""))).lower() in _ASSISTANT:
                    prompt, answer = turn.get("value", turn.get("content")), reply.get("value", reply.get("content"))
                    if isinstance(prompt, str) and isinstance(answer, str):
                        return prompt, answer
                    return None
            return None
    return None


def sharegpt_requests(
    path: str | Path,
    num_requests: int,
    tokenizer: Tokenizer | None = None,
    output_len: int | None = None,
    seed: int = 0,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """Up to ``num_requests`` prompts from a ShareGPT JSON file, shuffled with ``seed``.

    The output length is the reply's token count unless ``output_len`` overrides it. Like vllm,
    pairs with a prompt or reply under ``min_len`` tokens, a prompt over ``max_prompt_len`` or a
    total over ``max_total_len`` are skipped (length filters apply only without an override).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [p for p in (_first_exchange(c) for c in data if isinstance(c, Mapping)) if p is not None]
    random.Random(seed).shuffle(pairs)

    requests: list[BenchRequest] = []
    for prompt, answer in pairs:
        if len(requests) >= num_requests:
            break
        prompt_len = count_tokens(prompt, tokenizer)
        if output_len is None:
            n_out = count_tokens(answer, tokenizer)
            if prompt_len < min_len or n_out < min_len:
                continue
            if prompt_len > max_prompt_len or prompt_len + n_out > max_total_len:
                continue
        else:
            n_out = output_len
        requests.append(BenchRequest(prompt, prompt_len, n_out, kind="sharegpt"))
    return requests


# ---------------------------------------------------------------------------------------------
# structured

STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "regex", "choice")

_SUBJECTS = ("a librarian", "a pilot", "a chef", "a gardener", "a chemist", "a sailor", "a painter", "a nurse")
_PRODUCTS = ("a desk lamp", "a bicycle", "a tea kettle", "a backpack", "a keyboard", "a tent")
_REVIEWS = (
    "The battery lasts all day and the screen is bright.",
    "It broke after two days and support never answered.",
    "Does what it says. Nothing more, nothing less.",
    "Shipping was slow but the quality surprised me.",
)
_PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "email", "skills"],
    "additionalProperties": False,
}
_PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "price": {"type": "number"},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "price", "in_stock"],
    "additionalProperties": False,
}
_REGEXES = (
    ("an ISO date (YYYY-MM-DD) for a day in spring", r"\d{4}-(0[3-5])-\d{2}"),
    ("a US phone number like 555-123-4567", r"\d{3}-\d{3}-\d{4}"),
    ("an email address for {subject}", r"[a-z0-9._]{1,20}@[a-z]{2,12}\.(com|org|net)"),
    ("a semantic version number", r"(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})"),
)
_CHOICES = ("positive", "negative", "neutral")


def _structured_one(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    if kind == "json_schema":
        if rng.random() < 0.5:
            subject = rng.choice(_SUBJECTS)
            prompt = f"Describe {subject} as a JSON object with name, age, email and skills."
            name, schema = "person", _PERSON_SCHEMA
        else:
            product = rng.choice(_PRODUCTS)
            prompt = f"Write a store listing for {product} as JSON with title, price, stock status and tags."
            name, schema = "product", _PRODUCT_SCHEMA
        # OpenAI's standard field, which OpenAI-compatible servers accept for JSON schemas.
        return prompt, {
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        }
    if kind == "regex":
        what, pattern = rng.choice(_REGEXES)
        prompt = "Answer with only " + what.format(subject=rng.choice(_SUBJECTS)) + "."
        # vllm's extension body field; OpenAI has no regex constraint.
        return prompt, {"structured_outputs": {"regex": pattern}}
    if kind == "choice":
        prompt = f"Classify the sentiment of this review as positive, negative or neutral: {rng.choice(_REVIEWS)}"
        return prompt, {"structured_outputs": {"choice": list(_CHOICES)}}
    raise ValueError(f"unknown structured kind {kind!r}; expected one of {', '.join(STRUCTURED_KINDS)}")


def parse_structured_mix(text: str) -> dict[str, float]:
    """Parse "json_schema=2,regex=1,choice=1" into normalised-later weights."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if name not in STRUCTURED_KINDS:
            raise ValueError(f"unknown structured kind {name!r}; expected one of {', '.join(STRUCTURED_KINDS)}")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"weight {value!r} for {name} is not a number") from None
        if weight < 0:
            raise ValueError(f"weight for {name} must be >= 0")
        weights[name] = weight
    if not weights or sum(weights.values()) <= 0:
        raise ValueError("structured mix needs at least one positive weight")
    return weights


def structured_requests(
    num_requests: int,
    output_len: int = 256,
    mix: Mapping[str, float] | None = None,
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """A seeded mix of constrained requests: json_schema via ``response_format``, regex and choice
    via ``structured_outputs``. ``output_len`` is a ``max_tokens`` cap, not a forced length."""
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    weights = dict(mix) if mix else {k: 1.0 for k in STRUCTURED_KINDS}
    for name in weights:
        if name not in STRUCTURED_KINDS:
            raise ValueError(f"unknown structured kind {name!r}")
    rng = random.Random(seed)
    kinds = rng.choices(list(weights), weights=list(weights.values()), k=num_requests)
    requests = []
    for kind in kinds:
        prompt, body = _structured_one(kind, rng)
        requests.append(
            BenchRequest(
                prompt,
                count_tokens(prompt, tokenizer),
                output_len,
                extra_body=body,
                fixed_output=False,
                kind=f"structured:{kind}",
            )
        )
    return requests


# ---------------------------------------------------------------------------------------------
# random-mm


def noise_png(width: int, height: int, rng: np.random.Generator) -> str:
    """A data URL of a PNG of seeded noise (PNG: lossless, so each image is its own item)."""
    import base64
    import io

    from PIL import Image

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def random_mm_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    image_size: tuple[int, int] = (336, 336),
    images_per_request: int = 1,
    distinct_images: int = 0,
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """``random_requests`` whose user message opens with ``images_per_request`` images of
    ``image_size`` (width, height): every image new (``distinct_images`` 0), or each drawn in turn
    from that many (the same image again: the encoder and prefix caches' hit path)."""
    if images_per_request < 1 or distinct_images < 0:
        raise ValueError("images_per_request must be >= 1 and distinct_images >= 0")
    rng = np.random.default_rng(seed + 1)
    pool = [noise_png(*image_size, rng) for _ in range(distinct_images)]
    out = []
    for i, req in enumerate(random_requests(num_requests, input_len, output_len,
                                            tokenizer=tokenizer, seed=seed)):
        urls = [pool[(i * images_per_request + k) % len(pool)] if pool
                else noise_png(*image_size, rng) for k in range(images_per_request)]
        content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        content.append({"type": "text", "text": req.prompt})
        out.append(BenchRequest(req.prompt, req.prompt_len, req.output_len,
                                messages=({"role": "user", "content": content},),
                                kind="random-mm"))
    return out


DATASETS: tuple[str, ...] = ("random", "sharegpt", "structured", "random-mm")
