"""Issue 3, part 1: every request parameter is honoured, end to end through one real Serve app.

The embedded model has random weights, so tests never read meaning into its text. They compare
outputs of the same request with and without a parameter, check invariants (ids vs text, usage vs
/tokenize), or force exact outputs: see `forced`."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import PLAIN_APP, shared_app

MODEL = "shardserve/tiny-llama"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE, THINK, THINK_END = 3992, 3993, 3994, 3995, 3996, 3997
HE, L, LO, WORLD, ABC = 264, 75, 309, 3241, 1620  # "he" "l" "lo" " world" "abc"
ISTANT = 1949  # "istant", a token of the default prompt ("<|im_start|>assistant")
EMOJI = [654, 246, 222]  # the four bytes of 😀 over three tokens
# {"name": "f"} as the tokens '{"' 'name' '":' ' "' 'f' '"' '}' (every one distinct)
CALL_F = [1688, 422, 544, 333, 69, 1, 92]
# a template that renders only the messages' text: the prompt shares no token with forced outputs
BARE_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
BARE_MESSAGES = [{"role": "user", "content": "Q?"}]


pytestmark = pytest.mark.shared_app("plain")


@pytest.fixture(scope="module")
def base_url() -> str:
    # the tests render bare prompts through per-request templates
    return shared_app(PLAIN_APP)


@pytest.fixture(scope="module")
def root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def chat(base_url: str, **body: Any) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, **body}
    r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def completion(base_url: str, **body: Any) -> dict:
    r = httpx.post(f"{base_url}/completions", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def error(base_url: str, path: str = "/chat/completions", status: int = 400,
          **body: Any) -> dict:
    body = {"model": MODEL, **({"messages": MESSAGES} if path == "/chat/completions" else {}),
            **body}
    r = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def sse_chunks(base_url: str, body: dict, path: str = "/chat/completions") -> list[dict]:
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = "".join(r.iter_text())
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def tokenize(root: str, **body: Any) -> list[int]:
    r = httpx.post(f"{root}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"])
    return out["tokens"]


def detokenize(root: str, ids: list[int]) -> str:
    r = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def forced(seq: list[int], **extra: Any) -> dict:
    """Request fields that make greedy decoding emit exactly `seq` (distinct token ids, none in
    the prompt): only `seq` may be sampled, each token is biased below the one before it, and a
    repetition penalty of 100 divides a token's (biased, positive) logit by 100 once it has been
    produced, so the next unused token of `seq` always wins."""
    assert len(set(seq)) == len(seq) <= 10
    return {"messages": BARE_MESSAGES, "chat_template": BARE_TEMPLATE, "temperature": 0,
            "allowed_token_ids": seq,
            "logit_bias": {str(t): 100 - 10 * i for i, t in enumerate(seq)},
            "repetition_penalty": 100.0, "max_tokens": len(seq), **extra}


def message(response: dict, i: int = 0) -> dict:
    return response["choices"][i]["message"]


def ids_of(response: dict, i: int = 0) -> list[int]:
    return response["choices"][i]["token_ids"]


# ---- logit_bias, allowed_token_ids, bad_words --------------------------------------------------
def test_logit_bias_plus_100_forces_the_token(base_url: str) -> None:
    r = chat(base_url, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True,
             logit_bias={str(HE): 100}, logprobs=True, return_token_ids=True)
    assert ids_of(r) == [HE] * 6
    assert [e["token"] for e in r["choices"][0]["logprobs"]["content"]] == ["he"] * 6
    assert message(r)["content"] == "he" * 6


def test_logit_bias_minus_100_bans_the_greedy_token(base_url: str) -> None:
    greedy = ids_of(chat(base_url, max_tokens=4, temperature=0, ignore_eos=True,
                         return_token_ids=True))
    banned = ids_of(chat(base_url, max_tokens=4, temperature=0, ignore_eos=True,
                         return_token_ids=True, logit_bias={str(greedy[0]): -100}))
    assert banned[0] != greedy[0] and greedy[0] not in banned


def test_allowed_token_ids_restrict_every_token(base_url: str) -> None:
    allowed = [HE, L, LO, WORLD, ABC]
    r = chat(base_url, max_tokens=24, temperature=1.5, seed=3, ignore_eos=True,
             allowed_token_ids=allowed, return_token_ids=True)
    assert len(ids_of(r)) == 24 and set(ids_of(r)) <= set(allowed)
    assert len(set(ids_of(r))) > 1  # sampled, not stuck


def test_forcing_helper_emits_the_sequence(base_url: str) -> None:
    r = chat(base_url, **forced([HE, L, LO, WORLD]), return_token_ids=True)
    assert ids_of(r) == [HE, L, LO, WORLD] and message(r)["content"] == "hello world"


def test_bad_words_single_token_never_produced(base_url: str, root: str) -> None:
    body = dict(max_tokens=30, temperature=0, ignore_eos=True, return_token_ids=True,
                logit_bias={str(HE): 3})
    assert ids_of(chat(base_url, **body)).count(HE) >= 8  # the bias makes "he" frequent
    spaced = tokenize(root, prompt=" he", add_special_tokens=False)
    banned = ids_of(chat(base_url, **body, bad_words=["he"]))
    assert HE not in banned and len(banned) == 30
    if len(spaced) == 1:  # " he" is banned as well, as in vLLM
        assert spaced[0] not in banned


def test_bad_words_multi_token_sequence_never_completed(base_url: str) -> None:
    seq = [HE, L, LO, WORLD]
    r = chat(base_url, **forced(seq), bad_words=["hello"], return_token_ids=True)
    out = ids_of(r)
    assert "hello" not in message(r)["content"]
    assert out[:2] == [HE, L] and out[2] != LO  # the last token of the word is what's banned


# ---- stop, stop_token_ids, min_tokens, ignore_eos, max_tokens ----------------------------------
def test_stop_string_across_tokens_and_include_stop_str(base_url: str) -> None:
    seq = [HE, L, LO, WORLD]  # "he" "l" "lo" " world"
    cut = chat(base_url, **forced(seq), stop=["lo w"])
    assert message(cut)["content"] == "hel"
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["stop_reason"] == "lo w"
    kept = chat(base_url, **forced(seq), stop=["lo w", "zzz"], include_stop_str_in_output=True)
    assert message(kept)["content"] == "hello w"
    streamed = sse_chunks(base_url, {**forced(seq), "stop": "lo w"})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == "hel"
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_with_stop_reason(base_url: str, root: str) -> None:
    base = ids_of(chat(base_url, max_tokens=12, temperature=0, ignore_eos=True,
                       return_token_ids=True))
    i = next(i for i in range(2, 12) if base[i] not in base[:i])
    r = chat(base_url, max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True,
             stop_token_ids=[base[i]])
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == base[i]
    assert c["token_ids"] == base[: i + 1]  # the stop token is in the ids ...
    assert c["message"]["content"] == detokenize(root, base[:i])  # ... but not in the text
    kept = chat(base_url, max_tokens=12, temperature=0, ignore_eos=True,
                stop_token_ids=[base[i]], include_stop_str_in_output=True)
    assert message(kept)["content"] == detokenize(root, base[: i + 1])


def test_min_tokens_and_ignore_eos(base_url: str) -> None:
    eos = {str(IM_END): 100}
    r = chat(base_url, max_tokens=10, temperature=0, logit_bias=eos, return_token_ids=True)
    assert ids_of(r) == [IM_END] and r["choices"][0]["finish_reason"] == "stop"
    assert message(r)["content"] == ""
    r = chat(base_url, max_tokens=10, temperature=0, logit_bias=eos, min_tokens=5,
             return_token_ids=True)
    assert len(ids_of(r)) == 6 and ids_of(r)[-1] == IM_END and IM_END not in ids_of(r)[:5]
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 6
    r = chat(base_url, max_tokens=7, temperature=0, logit_bias=eos, ignore_eos=True,
             return_token_ids=True)
    assert ids_of(r) == [IM_END] * 7 and r["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_wins_over_max_tokens(base_url: str) -> None:
    r = chat(base_url, max_tokens=3, temperature=0, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 3
    r = chat(base_url, max_tokens=3, max_completion_tokens=5, temperature=0, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
    r = chat(base_url, max_tokens=9, max_completion_tokens=2, temperature=0, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 2
    err = error(base_url, max_tokens=5, max_completion_tokens=2000)
    assert err["param"] == "max_completion_tokens" and "maximum context length" in err["message"]


# ---- logprobs ----------------------------------------------------------------------------------
def test_logprobs_and_top_logprobs(base_url: str) -> None:
    r = chat(base_url, max_tokens=8, temperature=0, ignore_eos=True, logprobs=True,
             top_logprobs=5, return_token_ids=True)
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == 8
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(e["token"], str) and e["logprob"] <= 0
        assert all(isinstance(b, int) and 0 <= b < 256 for b in e["bytes"])
        top = e["top_logprobs"]
        assert len(top) == 5
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(set(t) == {"token", "logprob", "bytes"} for t in top)
        # greedy: the chosen token is the most likely one
        assert (top[0]["token"], top[0]["logprob"]) == (e["token"], e["logprob"])
    none = chat(base_url, max_tokens=3, temperature=0, logprobs=True, top_logprobs=0)
    assert all(e["top_logprobs"] == [] for e in none["choices"][0]["logprobs"]["content"])
    assert chat(base_url, max_tokens=2)["choices"][0]["logprobs"] is None


def test_logprob_bytes_join_into_the_text(base_url: str) -> None:
    """Tokens that split a character read as U+FFFD, but their bytes are the real ones."""
    r = chat(base_url, **forced([*EMOJI, WORLD]), logprobs=True)
    entries = r["choices"][0]["logprobs"]["content"]
    assert message(r)["content"] == "😀 world"
    assert "\ufffd" in entries[0]["token"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8") == "😀 world"


def test_prompt_logprobs_one_per_prompt_token(base_url: str) -> None:
    r = chat(base_url, max_tokens=2, temperature=0, prompt_logprobs=2, return_token_ids=True)
    plp, prompt = r["prompt_logprobs"], r["prompt_token_ids"]
    assert len(plp) == len(prompt) == r["usage"]["prompt_tokens"]
    assert plp[0] is None
    for tid, entry in zip(prompt[1:], plp[1:]):
        assert str(tid) in entry and 1 <= len(entry) <= 3  # the prompt token + top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str)
                   for v in entry.values())
    assert chat(base_url, max_tokens=2)["prompt_logprobs"] is None


# ---- sampling: seed, penalties, min_p/top_k/top_p, n, best_of ----------------------------------
def test_seed_same_text_alone_and_inside_a_concurrent_batch(base_url: str) -> None:
    body = dict(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True,
                return_token_ids=True)
    alone = ids_of(chat(base_url, **body))
    others = [dict(messages=[{"role": "user", "content": f"Tell me about {i} things."}],
                   max_tokens=6 + i % 7, temperature=0.7 + i % 3 * 0.3,
                   seed=i if i % 2 else None, ignore_eos=True) for i in range(16)]
    with ThreadPoolExecutor(17) as pool:
        futures = [pool.submit(chat, base_url, **b) for b in others[:8]]
        mine = pool.submit(chat, base_url, **body)
        futures += [pool.submit(chat, base_url, **b) for b in others[8:]]
        assert all(f.result()["choices"][0]["finish_reason"] == "length" for f in futures)
        assert ids_of(mine.result()) == alone
    assert ids_of(chat(base_url, **{**body, "seed": 4321})) != alone


def test_extreme_seeds_are_valid(base_url: str) -> None:
    for seed in (2**63 - 1, -(2**63), 0):
        r = chat(base_url, max_tokens=3, temperature=1.0, seed=seed, n=2)
        assert len(r["choices"]) == 2


def test_penalties_reduce_repeats(base_url: str) -> None:
    body = dict(max_tokens=30, temperature=0, ignore_eos=True, return_token_ids=True,
                logit_bias={str(HE): 3})
    base = ids_of(chat(base_url, **body))
    assert base.count(HE) >= 8
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                    {"repetition_penalty": 2.0}):
        out = ids_of(chat(base_url, **body, **penalty))
        assert out != base and out.count(HE) <= 2, penalty
        assert max(Counter(out).values()) < max(Counter(base).values()), penalty
    mild = ids_of(chat(base_url, **body, frequency_penalty=0.5)).count(HE)
    assert 1 <= mild < base.count(HE)


def test_repetition_penalty_covers_prompt_tokens_presence_does_not(base_url: str) -> None:
    body = dict(max_tokens=20, temperature=0, ignore_eos=True, return_token_ids=True,
                logit_bias={str(ISTANT): 3})
    assert ids_of(chat(base_url, **body))[0] == ISTANT
    assert ids_of(chat(base_url, **body, presence_penalty=2.0))[0] == ISTANT
    assert ISTANT not in ids_of(chat(base_url, **body, repetition_penalty=1.5))


def test_min_p_top_k_top_p_degenerate_to_greedy(base_url: str) -> None:
    greedy = ids_of(chat(base_url, max_tokens=16, temperature=0, ignore_eos=True,
                         return_token_ids=True))
    sample = dict(max_tokens=16, temperature=1.5, seed=11, ignore_eos=True, return_token_ids=True)
    assert ids_of(chat(base_url, **sample)) != greedy
    for knob in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-9}):
        assert ids_of(chat(base_url, **sample, **knob)) == greedy, knob
    # off switches: top_k 0 / -1 and top_p 1 change nothing
    plain = ids_of(chat(base_url, **sample))
    for knob in ({"top_k": -1}, {"top_k": 0}, {"top_p": 1.0}, {"min_p": 0.0}):
        assert ids_of(chat(base_url, **sample, **knob)) == plain, knob


def test_n_choices(base_url: str) -> None:
    r = chat(base_url, max_tokens=5, temperature=1.0, n=3, ignore_eos=True)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 15
    assert len({message(r, i)["content"] for i in range(3)}) > 1


def test_best_of_returns_the_n_best_by_mean_logprob(base_url: str) -> None:
    kw = dict(max_tokens=8, temperature=1.2, seed=99, ignore_eos=True)
    four = chat(base_url, n=4, logprobs=True, **kw)
    means = [statistics.mean(e["logprob"] for e in c["logprobs"]["content"])
             for c in four["choices"]]
    order = sorted(range(4), key=lambda i: means[i], reverse=True)
    best = chat(base_url, n=2, best_of=4, **kw)
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [message(best, i)["content"] for i in range(2)] == [
        message(four, i)["content"] for i in order[:2]]
    assert best["usage"]["completion_tokens"] == 16  # as vLLM: only the returned choices count
    assert best["choices"][0]["logprobs"] is None  # ranking needs them, the client did not ask
    one = chat(base_url, best_of=4, **kw)
    assert len(one["choices"]) == 1 and message(one)["content"] == message(four, order[0])[
        "content"]


# ---- prompt shaping: memory_strategy, echo, continue_final_message, templates ------------------
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "First question about the sea?"},
                {"role": "assistant", "content": "First answer, about waves."},
                {"role": "user", "content": "Second question about mountains?"},
                {"role": "assistant", "content": "Second answer, about peaks."},
                {"role": "user", "content": "Third question?"}]


def test_memory_strategy_last_k_keeps_system_and_last_k(base_url: str, root: str) -> None:
    full = chat(base_url, messages=CONVERSATION, max_tokens=1)["usage"]["prompt_tokens"]
    assert full == len(tokenize(root, messages=CONVERSATION))
    for k, kept in ((1, [0, 5]), (3, [0, 3, 4, 5]), (10, [0, 1, 2, 3, 4, 5])):
        r = chat(base_url, messages=CONVERSATION, max_tokens=1, return_token_ids=True,
                 memory_strategy={"name": "last_k", "params": {"k": k}})
        expected = tokenize(root, messages=[CONVERSATION[i] for i in kept])
        assert r["prompt_token_ids"] == expected, k
        assert "You are terse." in detokenize(root, r["prompt_token_ids"])
    assert len(expected) == full
    assert len(tokenize(root, messages=[CONVERSATION[0], CONVERSATION[5]])) < full


CONTINUED = MESSAGES + [{"role": "assistant", "content": "Red, green"}]


def test_continue_final_message_prefills_the_answer(base_url: str, root: str) -> None:
    r = chat(base_url, messages=CONTINUED, continue_final_message=True,
             add_generation_prompt=False, max_tokens=4, temperature=0, ignore_eos=True,
             return_token_ids=True)
    prompt = r["prompt_token_ids"]
    assert prompt == tokenize(root, messages=CONTINUED, continue_final_message=True,
                              add_generation_prompt=False)
    assert detokenize(root, prompt).endswith("<|im_start|>assistant\nRed, green")
    closed = chat(base_url, messages=CONTINUED, max_tokens=1, return_token_ids=True)
    assert detokenize(root, closed["prompt_token_ids"]).endswith(
        "Red, green<|im_end|>\n<|im_start|>assistant\n")
    assert not message(r)["content"].startswith("Red, green")  # no echo asked


def test_echo_prepends_the_last_assistant_message(base_url: str, root: str) -> None:
    r = chat(base_url, messages=CONTINUED, continue_final_message=True,
             add_generation_prompt=False, echo=True, max_tokens=4, temperature=0,
             ignore_eos=True, return_token_ids=True)
    assert message(r)["content"] == "Red, green" + detokenize(root, ids_of(r))
    chunks = sse_chunks(base_url, {"messages": CONTINUED, "continue_final_message": True,
                                   "add_generation_prompt": False, "echo": True,
                                   "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == message(r)["content"]
    # the last message is the user's: nothing to echo for the assistant's answer
    plain = chat(base_url, echo=True, max_tokens=3, temperature=0, ignore_eos=True,
                 return_token_ids=True)
    assert message(plain)["content"] == detokenize(root, ids_of(plain))


def test_echo_with_add_generation_prompt_false_echoes_the_last_message(base_url: str) -> None:
    r = chat(base_url, echo=True, add_generation_prompt=False, max_tokens=2)
    assert message(r)["content"].startswith("Name three colours.")


def test_add_generation_prompt_false(base_url: str, root: str) -> None:
    on = chat(base_url, max_tokens=1, return_token_ids=True)["prompt_token_ids"]
    off = chat(base_url, max_tokens=1, return_token_ids=True,
               add_generation_prompt=False)["prompt_token_ids"]
    assert detokenize(root, on).endswith("colours.<|im_end|>\n<|im_start|>assistant\n")
    assert detokenize(root, off).endswith("colours.<|im_end|>\n")
    assert on[: len(off)] == off and len(on) > len(off)


def test_chat_template_override(base_url: str, root: str) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    r = chat(base_url, chat_template=template, max_tokens=1, return_token_ids=True)
    text = "[system] You are terse.\n[user] Name three colours.\n"
    assert r["prompt_token_ids"] == tokenize(root, prompt=text, add_special_tokens=False)
    assert r["usage"]["prompt_tokens"] != len(tokenize(root, messages=MESSAGES))
    assert tokenize(root, messages=MESSAGES, chat_template=template) == r["prompt_token_ids"]
    err = error(base_url, chat_template="{% for m in messages %}{{ m.content }}")
    assert err["param"] == "chat_template" and "template" in err["message"]
    err = error(base_url, chat_template="{{ ().__class__.__base__.__subclasses__() }}")
    assert err["param"] == "chat_template"  # the sandbox refuses it


def test_chat_template_kwargs_enable_thinking(base_url: str, root: str) -> None:
    on = chat(base_url, max_tokens=1, return_token_ids=True)
    off = chat(base_url, max_tokens=1, return_token_ids=True,
               chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert detokenize(root, off["prompt_token_ids"]).endswith(
        "assistant\n<think>\n\n</think>\n\n")
    assert off["prompt_token_ids"] == tokenize(root, messages=MESSAGES,
                                               chat_template_kwargs={"enable_thinking": False})


def test_documents_reach_the_template(base_url: str, root: str) -> None:
    docs = [{"title": "Geography", "text": "Paris is the capital of France."}]
    plain = chat(base_url, max_tokens=1)["usage"]["prompt_tokens"]
    r = chat(base_url, documents=docs, max_tokens=1, return_token_ids=True)
    assert r["usage"]["prompt_tokens"] > plain
    prompt = detokenize(root, r["prompt_token_ids"])
    assert '<document index="1">\nTitle: Geography\nParis is the capital of France.' in prompt


def test_reasoning_effort_reaches_the_template(base_url: str, root: str) -> None:
    r = chat(base_url, reasoning_effort="high", max_tokens=1, return_token_ids=True)
    assert "Reasoning effort: high" in detokenize(root, r["prompt_token_ids"])
    assert r["prompt_token_ids"] == tokenize(
        root, messages=MESSAGES, chat_template_kwargs={"reasoning_effort": "high"})


def test_truncate_prompt_tokens_keeps_the_last_k(base_url: str, root: str) -> None:
    full = tokenize(root, messages=MESSAGES)
    r = chat(base_url, truncate_prompt_tokens=6, max_tokens=1, return_token_ids=True)
    assert r["usage"]["prompt_tokens"] == 6 and r["prompt_token_ids"] == full[-6:]
    r = chat(base_url, truncate_prompt_tokens=-1, max_tokens=1, return_token_ids=True)
    assert r["prompt_token_ids"] == full  # -1: the context length, longer than the prompt


def test_multimodal_parts_rejected_text_parts_joined(base_url: str, root: str) -> None:
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": " colours."}]
    r = chat(base_url, messages=[MESSAGES[0], {"role": "user", "content": parts}], max_tokens=1,
             return_token_ids=True)
    assert r["prompt_token_ids"] == tokenize(root, messages=MESSAGES)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    err = error(base_url, messages=[{"role": "user", "content": [parts[0], image]}])
    assert err["param"] == "messages[0].content[1].type" and "image_url" in err["message"]


def test_message_forms_render_alike(base_url: str, root: str) -> None:
    expected = tokenize(root, messages=MESSAGES)
    developer = [{"role": "developer", "content": "You are terse."}, MESSAGES[1]]
    harmony = [{"author": {"role": "system"}, "content": "You are terse."},
               {"author": {"role": "user", "name": "ann"}, "channel": "final",
                "recipient": "assistant", "content": "Name three colours."}]
    parts = [MESSAGES[0], {"role": "user", "name": "ann", "content": [
        {"type": "text", "text": "Name three colours."}]}]
    for form in (developer, harmony, parts):
        r = chat(base_url, messages=form, max_tokens=1, return_token_ids=True)
        assert r["prompt_token_ids"] == expected, form


# ---- reasoning and tools -----------------------------------------------------------------------
THINK_SEQ = [THINK, ABC, THINK_END, WORLD, IM_END]  # <think>abc</think> world<|im_end|>


def test_include_reasoning(base_url: str) -> None:
    r = chat(base_url, **forced(THINK_SEQ), return_token_ids=True)
    assert ids_of(r) == THINK_SEQ and r["choices"][0]["finish_reason"] == "stop"
    assert message(r)["reasoning_content"] == "abc" and message(r)["content"] == " world"
    hidden = chat(base_url, **forced(THINK_SEQ), include_reasoning=False)
    assert message(hidden)["reasoning_content"] is None
    assert message(hidden)["content"] == " world"
    chunks = sse_chunks(base_url, forced(THINK_SEQ))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "abc"
    assert "".join(d.get("content") or "" for d in deltas) == " world"
    chunks = sse_chunks(base_url, forced(THINK_SEQ, include_reasoning=False))
    assert not any(c["choices"][0]["delta"].get("reasoning_content") for c in chunks)


TOOLS = [{"type": "function", "function": {
    "name": "f", "description": "Looks things up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
TOOL_SEQ = [TOOL_OPEN, *CALL_F, TOOL_CLOSE, IM_END]  # <tool_call>{"name": "f"}</tool_call>


def test_tool_call_parsed_end_to_end(base_url: str) -> None:
    r = chat(base_url, **forced(TOOL_SEQ), tools=TOOLS, tool_choice="auto",
             return_token_ids=True)
    c = r["choices"][0]
    assert c["token_ids"] == TOOL_SEQ
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"] == {"name": "f", "arguments": "{}"}
    chunks = sse_chunks(base_url, {**forced(TOOL_SEQ), "tools": TOOLS})
    calls = [t for ch in chunks for t in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert [(t["index"], t["function"]["name"], t["function"]["arguments"]) for t in calls] == [
        (0, "f", "{}")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    none = chat(base_url, **forced(TOOL_SEQ), tools=TOOLS, tool_choice="none")
    assert message(none)["content"] == '<tool_call>{"name": "f"}</tool_call>'
    assert message(none)["tool_calls"] == [] and none["choices"][0]["finish_reason"] == "stop"


def test_tools_are_rendered_into_the_prompt(base_url: str, root: str) -> None:
    plain = chat(base_url, max_tokens=1)["usage"]["prompt_tokens"]
    r = chat(base_url, tools=TOOLS, max_tokens=1, return_token_ids=True)
    assert r["usage"]["prompt_tokens"] > plain
    assert r["prompt_token_ids"] == tokenize(root, messages=MESSAGES, tools=TOOLS)
    assert '"name": "f"' in detokenize(root, r["prompt_token_ids"])
    err = error(base_url, tool_choice="auto")
    assert err["param"] == "tool_choice"


def test_assistant_tool_calls_and_tool_results_render(base_url: str, root: str) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{\"q\": \"colours\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "red, green, blue"}]
    r = chat(base_url, messages=history, tools=TOOLS, max_tokens=1, return_token_ids=True)
    prompt = detokenize(root, r["prompt_token_ids"])
    assert '<tool_call>\n{"name": "f", "arguments": {"q": "colours"}}\n</tool_call>' in prompt
    assert "<tool_response>\nred, green, blue\n</tool_response>" in prompt


# ---- output switches ---------------------------------------------------------------------------
def test_return_token_ids_consistent_with_text(base_url: str, root: str) -> None:
    r = chat(base_url, max_tokens=10, temperature=0, ignore_eos=True, return_token_ids=True)
    ids = ids_of(r)
    assert len(ids) == 10 == r["usage"]["completion_tokens"]
    assert message(r)["content"] == detokenize(root, ids)
    assert r["prompt_token_ids"] == tokenize(root, messages=MESSAGES)
    chunks = sse_chunks(base_url, {"messages": MESSAGES, "max_tokens": 10, "temperature": 0,
                                   "ignore_eos": True, "return_token_ids": True})
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == ids
    plain = chat(base_url, max_tokens=2)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


def test_return_tokens_as_token_ids(base_url: str) -> None:
    r = chat(base_url, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
             top_logprobs=2, return_token_ids=True, return_tokens_as_token_ids=True)
    entries = r["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids_of(r)]
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in entries)


def test_skip_special_tokens_and_spaces_between_them(base_url: str) -> None:
    seq = [WORLD, IM_END, IM_START, HE]
    body = forced(seq, ignore_eos=True)
    assert message(chat(base_url, **body))["content"] == " worldhe"
    shown = chat(base_url, **body, skip_special_tokens=False)
    assert message(shown)["content"] == " world <|im_end|> <|im_start|> he"
    tight = chat(base_url, **body, skip_special_tokens=False,
                 spaces_between_special_tokens=False)
    assert message(tight)["content"] == " world<|im_end|><|im_start|>he"


def test_request_id_echoed_in_id_and_header(base_url: str) -> None:
    def header(r: httpx.Response) -> list[str]:
        return r.headers.get_list("x-request-id")

    rid = f"req-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    r = httpx.post(f"{base_url}/chat/completions", json={**body, "request_id": rid}, timeout=60)
    assert r.json()["id"] == f"chatcmpl-{rid}" and rid in header(r)
    hdr = f"hdr-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{base_url}/chat/completions", json=body, headers={"X-Request-Id": hdr},
                   timeout=60)
    assert r.json()["id"] == f"chatcmpl-{hdr}" and set(header(r)) == {hdr}
    r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60)
    assert r.json()["id"] == "chatcmpl-" + header(r)[0]
    chunks = sse_chunks(base_url, {**body, "request_id": rid + "s"})
    assert {c["id"] for c in chunks} == {f"chatcmpl-{rid}s"}
    r = httpx.post(f"{base_url}/completions", json={"model": MODEL, "prompt": "hi",
                                                    "max_tokens": 2, "request_id": rid},
                   timeout=60)
    assert r.json()["id"] == f"cmpl-{rid}" and rid in header(r)


def test_a_retry_with_the_same_request_id_while_the_first_runs_is_served(base_url: str) -> None:
    rid = f"retry-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "ignore_eos": True}

    def post() -> httpx.Response:
        return httpx.post(f"{base_url}/chat/completions", json=body, timeout=60,
                          headers={"X-Request-Id": rid})
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: post(), range(2)))
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert {r.json()["id"] for r in answers} == {f"chatcmpl-{rid}"}


def test_one_x_request_id_header(base_url: str) -> None:
    r = httpx.post(f"{base_url}/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert len(r.headers.get_list("x-request-id")) == 1


def test_continuous_usage_stats_on_every_content_chunk(base_url: str) -> None:
    chunks = sse_chunks(base_url, {"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True,
                                   "stream_options": {"include_usage": True,
                                                      "continuous_usage_stats": True}})
    body = [c for c in chunks[1:] if c["choices"]]  # tokens may share a chunk
    completion = [c["usage"]["completion_tokens"] for c in body]
    assert completion == sorted(set(completion)) and completion[-1] == 5
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"]
               + c["usage"]["completion_tokens"] for c in body)
    assert all(c["usage"]["prompt_tokens"] == body[0]["usage"]["prompt_tokens"] for c in body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    without = sse_chunks(base_url, {"messages": MESSAGES, "max_tokens": 3,
                                    "stream_options": {"include_usage": False}})
    assert not any(c.get("usage") for c in without)


def test_continuous_usage_stats_on_the_role_chunk_too(base_url: str) -> None:
    chunks = sse_chunks(base_url, {"messages": MESSAGES, "max_tokens": 2, "stream_options": {
        "continuous_usage_stats": True}})
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[0]["usage"]["completion_tokens"] == 0


def test_streamed_answer_concatenates_to_the_non_streamed_one(client: OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, seed=42, temperature=1.0,
                  stop=["\n\n"], extra_body={"ignore_eos": True, "top_k": 50,
                                              "repetition_penalty": 1.2})
    full = client.chat.completions.create(**kwargs)
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(parts) == full.choices[0].message.content


# ---- scheduling and tenancy knobs --------------------------------------------------------------
def test_priority_needs_priority_scheduling(base_url: str) -> None:
    assert chat(base_url, priority=0, max_tokens=1)["choices"]
    err = error(base_url, priority=5)
    assert err["param"] == "priority"


def test_inference_timeout_is_a_408_and_frees_the_request(base_url: str, root: str) -> None:
    err = error(base_url, status=408, max_tokens=900, ignore_eos=True, inference_timeout=0.3)
    assert err["param"] == "inference_timeout"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{root}/metrics", timeout=30).text
        running = [line for line in metrics.splitlines()
                   if line.startswith("vllm:num_requests_running{")]
        if running and float(running[0].rsplit(" ", 1)[1]) == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the timed-out request kept running")


def test_cache_salt_isolates_prefix_cache(base_url: str) -> None:
    salt = uuid.uuid4().hex
    msgs = [{"role": "user", "content": "A prompt long enough to fill more than one block of "
                                        "sixteen tokens in the cache, " + salt}]
    first = chat(base_url, messages=msgs, cache_salt=salt, max_tokens=1)["usage"]
    assert first["prompt_tokens"] > 32
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = chat(base_url, messages=msgs, cache_salt=salt, max_tokens=1)["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0
    other = chat(base_url, messages=msgs, cache_salt=salt + "-other", max_tokens=1)["usage"]
    assert other["prompt_tokens_details"]["cached_tokens"] == 0


def test_user_and_unknown_fields_are_accepted(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, user="user-1234",
        extra_body={"not_a_parameter": {"x": 1}, "vllm_xargs": {},
                    "kv_transfer_params": None, "mm_processor_kwargs": {}})
    assert r.choices[0].message.role == "assistant"


@pytest.mark.parametrize(("field", "value"), [
    ("vllm_xargs", {"a": 1}), ("kv_transfer_params", {"do_remote_prefill": True}),
    ("inference_extra_params", {"x": 1}), ("inference_extra_headers", {"x-y": "1"}),
    ("mm_processor_kwargs", {"num_crops": 4})])
def test_fields_shardserve_cannot_honour_are_refused(base_url: str, field: str,
                                                      value: object) -> None:
    """Never accepted and ignored: a 400 that names the field and says why."""
    err = error(base_url, **{field: value})
    assert err["param"] == field and "not supported" in err["message"]


def test_predicted_outputs_change_no_greedy_text_and_count_the_draft(
        base_url: str, client: OpenAI) -> None:
    """`prediction` (OpenAI's Predicted Outputs) is a draft the model verifies: greedy text is
    the same with a right, an edited or a wrong prediction, and usage says how much of it was
    kept, streamed or not."""
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    plain = chat(base_url, **body)
    text = message(plain)["content"]
    assert plain["usage"].get("completion_tokens_details") is None
    words = text.split(" ")
    edited = " ".join(words[:3] + ["zebra"] + words[4:])
    for guess in (text, edited, "Completely unrelated words about the weather."):
        got = chat(base_url, prediction={"type": "content", "content": guess}, **body)
        assert message(got)["content"] == text, guess
        usage = got["usage"]
        details = usage["completion_tokens_details"]
        assert usage["completion_tokens"] == 40
        assert 0 <= details["accepted_prediction_tokens"] <= 40
        assert details["rejected_prediction_tokens"] >= 0
        if guess == text:
            # (fewer than 39: this random model's text has broken UTF-8 pieces, which tokenize
            # differently from the tokens that made them)
            assert details["accepted_prediction_tokens"] >= 20, details
    stream = client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": text}]},
        **{k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    parts, usage = [], None
    for c in stream:
        parts += [c.choices[0].delta.content or ""] if c.choices else []
        usage = c.usage or usage
    assert "".join(parts) == text
    assert usage.completion_tokens_details.accepted_prediction_tokens >= 20


@pytest.mark.parametrize(("extra", "says"), [
    ({"prediction": {"type": "text", "content": "x"}}, '"type": "content"'),
    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "text parts"),
    ({"prediction": {"type": "content", "content": "x"}, "n": 2}, "combined with n"),
    ({"prediction": {"type": "content", "content": "x"}, "logprobs": True}, "logprobs"),
    ({"prediction": {"type": "content", "content": "x"},
      "response_format": {"type": "json_object"}}, "an output constraint")])
def test_predictions_the_draft_cannot_serve_are_refused(base_url: str, extra: dict,
                                                        says: str) -> None:
    err = error(base_url, **extra)
    assert err["param"] == "prediction" and says in err["message"], err


def test_logits_processors_need_the_allowlist(base_url: str) -> None:
    err = error(base_url, logits_processors=["my_pkg.NoRepeat"])
    assert err["param"] == "logits_processors" and "my_pkg.NoRepeat" in err["message"]
    err = error(base_url, logits_processors=[{"qualname": "os.system", "args": ["ls"]}])
    assert err["param"] == "logits_processors"


def test_model_name_forms(base_url: str, root: str, client: OpenAI) -> None:
    for name in ("acme/tiny-llama", "acme/tiny-llama/prod", "tiny-llama", MODEL,
                 f"{MODEL}/prod"):
        assert chat(base_url, model=name, max_tokens=1)["model"] == MODEL, name
    assert httpx.get(f"{base_url}/models/acme/tiny-llama").json()["id"] == MODEL
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="acme/other-model", messages=MESSAGES,
                                       max_tokens=1)
    assert exc.value.status_code == 404 and exc.value.body["param"] == "model"
    assert error(base_url, status=404, model="llama-9000")["param"] == "model"


# ---- /v1/completions ---------------------------------------------------------------------------
def test_completions_prompt_forms(base_url: str, root: str) -> None:
    one = completion(base_url, prompt="The sea is", max_tokens=4, temperature=0,
                     ignore_eos=True)
    assert one["object"] == "text_completion" and len(one["choices"]) == 1
    assert one["usage"]["prompt_tokens"] == len(tokenize(root, prompt="The sea is"))
    two = completion(base_url, prompt=["The sea is", "Mountains are"], max_tokens=4,
                     temperature=0, ignore_eos=True)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == one["choices"][0]["text"]
    assert two["usage"]["completion_tokens"] == 8
    # the prompts of a list run at once: a list of 8 takes far less than 8 times one
    started = time.monotonic()
    completion(base_url, prompt="The sea is", max_tokens=48, temperature=0, ignore_eos=True)
    alone = time.monotonic() - started
    started = time.monotonic()
    eight = completion(base_url, prompt=["The sea is"] * 8, max_tokens=48, temperature=0,
                       ignore_eos=True)
    together = time.monotonic() - started
    assert len({c["text"] for c in eight["choices"]}) == 1 and together < 4 * alone
    ids = tokenize(root, prompt="Mountains are")
    by_ids = completion(base_url, prompt=ids, max_tokens=4, temperature=0, ignore_eos=True)
    assert by_ids["choices"][0]["text"] == two["choices"][1]["text"]
    lists = completion(base_url, prompt=[tokenize(root, prompt="The sea is"), ids],
                       max_tokens=4, temperature=0, ignore_eos=True)
    assert [c["text"] for c in lists["choices"]] == [c["text"] for c in two["choices"]]
    assert lists["usage"]["prompt_tokens"] == two["usage"]["prompt_tokens"]


def test_completions_echo_logprobs_and_suffix(base_url: str, root: str) -> None:
    """As vLLM: with echo, the prompt's tokens come first in logprobs (the first without a
    logprob), and text_offset counts the echoed prompt; the same when streamed."""
    prompt_ids = tokenize(root, prompt="The sea is")
    p = len(prompt_ids)
    r = completion(base_url, prompt="The sea is", max_tokens=5, temperature=0, echo=True,
                   ignore_eos=True, logprobs=3, return_token_ids=True)
    c = r["choices"][0]
    assert c["text"].startswith("The sea is") and len(c["text"]) > len("The sea is")
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == p + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:p]) == "The sea is"
    assert lp["text_offset"][:p] == sorted(lp["text_offset"][:p])
    assert lp["text_offset"][p] == len("The sea is")  # the first generated token's place
    assert "".join(lp["tokens"][p:]) == c["text"][len("The sea is"):]
    assert len(c["token_ids"]) == 5
    streamed = sse_chunks(base_url, {"prompt": "The sea is", "max_tokens": 5, "temperature": 0,
                                     "ignore_eos": True, "echo": True, "logprobs": 3},
                          "/completions")
    offsets = [o for ch in streamed if ch["choices"] and ch["choices"][0]["logprobs"]
               for o in ch["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    err = error(base_url, "/completions", prompt="def f(", suffix="return x")
    assert err["param"] == "suffix"
    streamed = sse_chunks(base_url, {"prompt": "The sea is", "max_tokens": 5, "temperature": 0,
                                     "ignore_eos": True, "echo": True}, "/completions")
    assert "".join(ch["choices"][0]["text"] for ch in streamed if ch["choices"]) == c["text"]


# ---- other endpoints ---------------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(root: str) -> None:
    text = "Hello world, 日本語 😀 <|im_end|> <think>x</think>"
    r = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": text,
                                             "return_token_strs": True}).json()
    assert r["max_model_len"] == 1024 and r["count"] == len(r["tokens"])
    assert len(r["token_strs"]) == r["count"] and IM_END in r["tokens"]
    assert detokenize(root, r["tokens"]) == text
    err = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": [4000]})
    assert err.status_code == 400 and err.json()["error"]["param"] == "tokens"


def test_version(root: str) -> None:
    r = httpx.get(f"{root}/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


def test_metrics_vllm_names(base_url: str, root: str) -> None:
    sse_chunks(base_url, {"messages": MESSAGES, "max_tokens": 3})
    text = httpx.get(f"{root}/metrics").text
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{",
                 "vllm:kv_cache_usage_perc{", "vllm:time_to_first_token_seconds_count{",
                 "vllm:e2e_request_latency_seconds_count{", "vllm:prompt_tokens_total{",
                 "vllm:generation_tokens_total{", "vllm:request_success_total{"):
        assert any(line.startswith(name) for line in text.splitlines()), name
    assert f'model_name="{MODEL}"' in text


def _ttft_count(root: str, name: str = "vllm:time_to_first_token_seconds_count{") -> float:
    for line in httpx.get(f"{root}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_streamed_completions(base_url: str, root: str) -> None:
    e2e = "vllm:e2e_request_latency_seconds_count{"
    before = (_ttft_count(root), _ttft_count(root, e2e))
    sse_chunks(base_url, {"prompt": "The sea is", "max_tokens": 3}, "/completions")
    assert (_ttft_count(root), _ttft_count(root, e2e)) == (before[0] + 1, before[1] + 1)


def test_metrics_time_to_first_token_counts_non_streamed_requests(base_url: str,
                                                                  root: str) -> None:
    before = _ttft_count(root)
    chat(base_url, max_tokens=2)
    assert _ttft_count(root) == before + 1


def test_the_guided_decoding_backend_asked_for_is_the_one_used(base_url: str) -> None:
    """Each constraint kind has one backend and no fallback: a request naming another, or one
    not served here, is refused; 'auto' or the right one is served."""
    err = error(base_url, guided_regex="a+", guided_decoding_backend="xgrammar")
    assert err["param"] == "guided_decoding_backend" and "one of" in err["message"]
    err = error(base_url, structured_outputs={"regex": "a+", "backend": "guidance"})
    assert err["param"] == "backend" and "outlines" in err["message"]
    err = error(base_url, structured_outputs={"json": {"type": "object"}, "backend": "outlines"})
    assert "llguidance" in err["message"]
    for backend in ("auto", "outlines"):
        r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 4,
            "structured_outputs": {"regex": "a{2}", "backend": backend}})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "aa"


def test_return_token_ids_streams_the_prompt_ids_in_each_choices_first_chunk(
        base_url: str) -> None:
    whole = chat(base_url, max_tokens=4, return_token_ids=True)
    chunks = sse_chunks(base_url, {"messages": MESSAGES, "max_tokens": 4, "n": 2,
                                   "temperature": 1, "return_token_ids": True})
    with_ids = [c for c in chunks if c.get("prompt_token_ids")]
    assert len(with_ids) == 2 and {c["choices"][0]["index"] for c in with_ids} == {0, 1}
    assert all(c["prompt_token_ids"] == whole["prompt_token_ids"] for c in with_ids)
    first = {}
    for c in chunks:
        for ch in c["choices"]:
            first.setdefault(ch["index"], c)
    assert all(first[i].get("prompt_token_ids") for i in (0, 1))
