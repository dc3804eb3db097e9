"""Trains the embedded model's byte-level BPE tokenizer and writes its shipped files.

Owns `tokenizer.json` and `tokenizer_config.json` next to this module. The corpus is text every
machine has offline: the Python standard library's docstrings and source (a sorted file list cut
at fixed limits), the team's seed texts under /work/shared/seeds if present, and built-in
multilingual samples. The output is shipped, so the server never trains at runtime; rerun with
`python -m replicas.embedded.train_tokenizer` only when the corpus or settings change (a
different Python version's standard library gives a different, equally valid, vocabulary).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

# Read by the Rust side before the first tokenizers call: training must not depend on thread timing.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

HERE = Path(__file__).resolve().parent
TOKENIZER_FILE = HERE / "tokenizer.json"
TOKENIZER_CONFIG_FILE = HERE / "tokenizer_config.json"
CHAT_TEMPLATE_FILE = HERE / "chat_template.jinja"
SEEDS_DIR = Path("/work/shared/seeds")

VOCAB_SIZE = 4000  # everything included: learned merges, byte alphabet and the added tokens below
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Non-special like Qwen's, so tool calls and reasoning survive decode(skip_special_tokens=True).
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
MODEL_MAX_LENGTH = 4096

# Qwen2's split: contractions, letter runs with one leading non-letter, single digits, punctuation
# runs, newlines. Single digits keep numbers from eating the vocabulary.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

MAX_STDLIB_FILES = 600
MAX_CHARS_PER_FILE = 60_000
DOCSTRING_BUDGET = 2_500_000  # characters of prose
SOURCE_BUDGET = 1_200_000  # characters of code, so indentation and operators get merges too
SAMPLE_REPEATS = 40  # the samples are tiny next to the stdlib; repeats give non-Latin scripts merges
SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                       "__pycache__", "turtledemo", "ensurepip", "tkinter"}

SAMPLES = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!",
    "Hello, world! How are you today? I'm fine, thanks — and you?",
    "Le cœur a ses raisons que la raison ne connaît point. Où est la bibliothèque ? À bientôt, garçon !",
    "Ça va très bien, merci. L'été dernier, nous sommes allés à la mer.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Grüße aus München, Straße 5.",
    "¿Dónde está la estación? El niño comió mañana una piña en Logroño. ¡Olé!",
    "Não há nada como a saudade. Ação, coração, informação, São Paulo.",
    "Tiếng Việt có dấu: Xin chào, tôi là người Việt Nam. Cảm ơn bạn rất nhiều.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy. Şişli'de güzel bir gün.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, как дела?",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε!",
    "مرحبا بالعالم. كيف حالك اليوم؟ شكرا جزيلا.",
    "שלום עולם. מה שלומך היום?",
    "नमस्ते दुनिया। आप कैसे हैं? धन्यवाद।",
    "日本語のテキストです。今日はいい天気ですね。東京、大阪、京都。ありがとうございます。",
    "こんにちは世界。私は学生です。カタカナ、ひらがな、漢字を使います。",
    "你好，世界！我们今天去北京。中文分词是一个有趣的问题。谢谢你的帮助。",
    "人工智能和机器学习正在改变世界。请用中文回答这个问题。",
    "안녕하세요 세계. 한국어를 공부하고 있습니다. 감사합니다!",
    "สวัสดีชาวโลก ขอบคุณมาก",
    "Emoji: 😀 😂 🤖 🚀 🎉 👍 ❤️ 🔥 ✅ ❌ ⭐ 🌍 🐍 🦀 👩‍💻 🇯🇵 🇫🇷",
    "Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π θ λ μ α β γ δ ε → ← ⇒ ∀ ∃ ∈ ∉ ∩ ∪ ° ± × ÷ ½ ²",
    "Prices: $19.99, €5,00, £3.50, ¥1000, ₹250. Dates: 2024-01-31T12:34:56Z.",
    '{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}',
    '[{"id": 1, "ok": true, "value": null, "items": [1.5, -2, 3e10]}, {"id": 2, "ok": false}]',
    "The assistant thinks step by step, then answers. The user asked a question about the weather.",
    "You are a helpful assistant. Answer concisely and accurately.",
)


def _stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if any(part in SKIPPED_STDLIB_DIRS or part.startswith("config-") for part in relative.parts[:-1]):
            continue
        files.append(path)
    return files[:MAX_STDLIB_FILES]


def _docstrings(source: str) -> Iterator[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old stdlib files carry invalid escape sequences
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node)
            if docstring:
                yield docstring


def corpus() -> Iterator[str]:
    """Yields the training texts in a fixed order."""
    docstring_chars = 0
    source_chars = 0
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")[:MAX_CHARS_PER_FILE]
            docstrings = list(_docstrings(source))
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for docstring in docstrings:
            if docstring_chars < DOCSTRING_BUDGET:
                docstring_chars += len(docstring)
                yield docstring
        if source_chars < SOURCE_BUDGET:
            source_chars += len(source)
            yield source
    if SEEDS_DIR.is_dir():
        for path in sorted(SEEDS_DIR.glob("*.txt")):
            yield path.read_text(encoding="utf-8", errors="replace")
    for _ in range(SAMPLE_REPEATS):
        yield from SAMPLES


def build_tokenizer() -> Tokenizer:
    """Trains the BPE model and adds the chat tokens after the learned vocabulary, like Qwen2."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No normalizer (Qwen2 has NFC): decode(encode(text)) must give back exactly the input bytes.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, chat_template: str) -> dict:
    """The transformers side: PreTrainedTokenizerFast loads tokenizer.json as is (Qwen2TokenizerFast
    would rebuild the pipeline with its own normalizer)."""
    added = {}
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        added[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def main() -> int:
    tokenizer = build_tokenizer()
    chat_template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    # tokenizers' own save() is compact and key-ordered, so reruns give byte-identical files.
    TOKENIZER_FILE.write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    config = tokenizer_config(tokenizer, chat_template)
    TOKENIZER_CONFIG_FILE.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    ids = {token: tokenizer.token_to_id(token) for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS)}
    print(f"vocab size {tokenizer.get_vocab_size()}, {TOKENIZER_FILE.stat().st_size} bytes; ids {ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
