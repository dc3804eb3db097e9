"""Request -> engine parameters: SamplingParams, the constraint spec, and the output switches.

All cross-field validation lives here (field-level checks are in protocol.py), and every alias
(`max_tokens` vs `max_completion_tokens`, `guided_*` vs `structured_outputs` vs `response_format`)
resolves here, so the rest of the ingress sees one canonical form."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from replicas.request import SamplingParams
from serve_app.errors import APIError
from serve_app.generation_defaults import SamplingDefaults
from serve_app.protocol import MAX_BAD_WORDS_TOKENS, ChatCompletionRequest, SamplingFields
from structured.spec import Constraint
from structured.schema_check import BACKEND_OF_KIND

# vLLM's names for the backends here ("guidance" is llguidance)
GUIDED_BACKENDS = {"auto": None, "outlines": "outlines", "llguidance": "llguidance",
                   "guidance": "llguidance"}
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class OutputOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings count from this many output tokens on
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    timeout_s: float | None = None


@dataclass(frozen=True)
class ServerLimits:
    max_model_len: int
    vocab_size: int
    max_n: int
    priority_scheduling: bool
    logits_processors: frozenset[str]
    defaults: SamplingDefaults = SamplingDefaults()  # the model's, for fields a request omits


def _given(value: Any, model_default: Any, openai_default: Any) -> Any:
    """The request's value, else the model's default (generation_defaults), else OpenAI's."""
    if value is not None:
        return value
    return openai_default if model_default is None else model_default


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise APIError(f"token ids {bad[:5]} are out of the vocabulary (size {vocab_size})",
                       param=param)


def _stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError(f"logit_bias token id {token} is out of the vocabulary "
                           f"(size {vocab_size})", param="logit_bias")
        out.append((token, max(-100.0, min(100.0, float(value)))))
    return tuple(out)


def _bad_words(words: list[str] | None, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """Each word is banned as it tokenizes alone and after a space, as vLLM does."""
    out: set[tuple[int, ...]] = set()
    for word in words or []:
        for variant in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(variant, add_special_tokens=False))
            if ids:
                out.add(ids)
    return tuple(sorted(out))


def _bounded(bad_words: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The engine keeps every bad word's tokens per sequence: bounded as vLLM bounds them."""
    total = sum(map(len, bad_words))
    if total > MAX_BAD_WORDS_TOKENS:
        raise APIError(f"the bad words come to {total} tokens (both spellings, with and without "
                       f"a leading space); at most {MAX_BAD_WORDS_TOKENS} are allowed",
                       param="bad_words")
    return bad_words


def constraint_of(request: SamplingFields) -> Constraint | None:
    """The one output constraint a request asks for, whichever of the three spellings it uses."""
    found: list[tuple[str, Constraint]] = []
    so = request.structured_outputs
    ws = request.guided_whitespace_pattern or (so.whitespace_pattern if so else None)
    no_add = bool(so and so.disable_additional_properties)
    no_ws = bool(so and so.disable_any_whitespace)

    def schema(value: Any, param: str) -> Constraint:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(f"the JSON schema is not valid JSON: {exc}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise APIError("the JSON schema must be an object", param=param)
        return Constraint("json_schema", json.dumps(value, sort_keys=True), ws, no_add, no_ws)

    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_object", "", ws, no_add, no_ws)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs json_schema.schema",
                           param="response_format.json_schema")
        found.append(("response_format", schema(rf.json_schema.schema_, "response_format")))
    elif rf is not None and rf.type == "structural_tag":
        spec = rf.model_dump(exclude_none=True)
        found.append(("response_format", Constraint("structural_tag", json.dumps(spec, sort_keys=True))))
    if so is not None:
        if so.json_ is not None:
            found.append(("structured_outputs.json", schema(so.json_, "structured_outputs.json")))
        if so.regex is not None:
            found.append(("structured_outputs.regex", Constraint("regex", so.regex)))
        if so.choice is not None:
            found.append(("structured_outputs.choice", Constraint("choice", json.dumps(so.choice))))
        if so.grammar is not None:
            found.append(("structured_outputs.grammar", Constraint("grammar", so.grammar)))
        if so.json_object:
            found.append(("structured_outputs.json_object", Constraint("json_object", "", ws, no_add, no_ws)))
        if so.structural_tag is not None:
            tag = so.structural_tag if isinstance(so.structural_tag, str) else json.dumps(
                so.structural_tag, sort_keys=True)
            found.append(("structured_outputs.structural_tag", Constraint("structural_tag", tag)))
    if request.guided_json is not None:
        found.append(("guided_json", schema(request.guided_json, "guided_json")))
    if request.guided_regex is not None:
        found.append(("guided_regex", Constraint("regex", request.guided_regex)))
    if request.guided_choice is not None:
        found.append(("guided_choice", Constraint("choice", json.dumps(request.guided_choice))))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", Constraint("grammar", request.guided_grammar)))
    if request.structural_tag is not None:
        found.append(("structural_tag", Constraint("structural_tag", request.structural_tag)))
    if len(found) > 1:
        raise APIError("only one output constraint may be given, got "
                       + ", ".join(name for name, _ in found), param=found[1][0])
    if found and found[0][1].kind == "choice" and not json.loads(found[0][1].value):
        raise APIError("choice needs at least one option", param=found[0][0])
    backend = request.guided_decoding_backend or (so.backend if so else None)
    if backend is not None:
        param = "guided_decoding_backend" if request.guided_decoding_backend else "backend"
        if backend not in GUIDED_BACKENDS:
            raise APIError(f"guided decoding backend {backend!r} is not served here (nor are "
                           "options after a colon: use structured_outputs' fields); one of "
                           f"{sorted(GUIDED_BACKENDS)}", param=param)
        wanted = GUIDED_BACKENDS[backend]
        if found and wanted is not None:
            kind = found[0][1].kind
            if BACKEND_OF_KIND[kind] != wanted:
                # each kind has one backend and never falls back to another, so a request for
                # another one is refused rather than quietly served by the wrong one
                raise APIError(f"{kind} constraints are compiled by {BACKEND_OF_KIND[kind]} "
                               f"here, not {backend}; send backend 'auto' or "
                               f"'{BACKEND_OF_KIND[kind]}'", param=param)
    return found[0][1] if found else None


# fields of vLLM's and others' APIs that shardserve has nothing to do with: a request that sets
# one is refused, never served as if it had not
UNSUPPORTED = {
    "vllm_xargs": "it carries arguments for vLLM's own plugins; custom logits processors take "
                  "theirs in logits_processors here",
    "kv_transfer_params": "shardserve has no KV connector (disaggregated prefill)",
    "inference_extra_params": "shardserve defines no extra inference parameters",
    "inference_extra_headers": "shardserve forwards no headers to a model backend",
}


def prediction_ids(request: ChatCompletionRequest, tokenizer: Any,
                   limits: ServerLimits) -> tuple[int, ...]:
    """OpenAI's Predicted Outputs: the prediction's tokens, the engine's speculative draft
    (replicas/prediction.py). Refused, as OpenAI does, beside what the draft cannot serve: a
    row whose tokens depend on more than its logits and sampling parameters."""
    p = request.prediction
    if not p:
        return ()
    content = p.get("content") if isinstance(p, dict) else None
    if p.get("type") != "content" or content is None:
        raise APIError('prediction must be {"type": "content", "content": <text or text parts>}',
                       param="prediction")
    if isinstance(content, list):
        if not all(isinstance(c, dict) and c.get("type") == "text"
                   and isinstance(c.get("text"), str) for c in content):
            raise APIError("prediction content parts must be text parts", param="prediction")
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise APIError("prediction content must be text", param="prediction")
    clashes = [name for name, on in (
        ("n", request.n > 1), ("best_of", (request.best_of or 1) > 1),
        ("logprobs", bool(request.logprobs)), ("tools", bool(request.tools)),
        ("presence_penalty", bool(request.presence_penalty)),
        ("frequency_penalty", bool(request.frequency_penalty)),
        ("repetition_penalty", request.repetition_penalty not in (None, 1.0)),
        ("logit_bias", bool(request.logit_bias)), ("bad_words", bool(request.bad_words)),
        ("allowed_token_ids", request.allowed_token_ids is not None),
        ("stop_token_ids", bool(request.stop_token_ids)), ("min_tokens", bool(request.min_tokens)),
        ("logits_processors", bool(request.logits_processors)),
        ("an output constraint", constraint_of(request) is not None)) if on]
    if clashes:
        raise APIError(f"prediction cannot be combined with {', '.join(clashes)} (as OpenAI's "
                       "Predicted Outputs)", param="prediction")
    ids = tuple(tokenizer.encode(content, add_special_tokens=False))
    if len(ids) > limits.max_model_len:
        raise APIError(f"the prediction is {len(ids)} tokens; at most max_model_len "
                       f"({limits.max_model_len})", param="prediction")
    return ids


def build(request: SamplingFields, *, prompt_len: int, limits: ServerLimits, tokenizer: Any,
          chat: bool) -> tuple[SamplingParams, OutputOptions]:
    for name, why in UNSUPPORTED.items():
        if getattr(request, name, None):  # absent, null or empty: nothing asked for
            raise APIError(f"{name} is not supported: {why}", param=name)
    max_tokens = request.max_tokens
    max_param = "max_tokens"
    if chat and isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens:
            max_tokens, max_param = request.max_completion_tokens, "max_completion_tokens"
        if request.modalities and any(m != "text" for m in request.modalities):
            raise APIError("audio output is not supported by this model: modalities may only "
                           "be [\"text\"]", param="modalities")
        if request.audio is not None:
            raise APIError("audio output is not supported by this model", param="audio")
    room = limits.max_model_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise APIError(f"This model's maximum context length is {limits.max_model_len} "
                           f"tokens. However, your messages resulted in {prompt_len} tokens.",
                           param="messages" if chat else "prompt")
        max_tokens = room
    elif max_tokens > room:
        raise APIError(f"This model's maximum context length is {limits.max_model_len} tokens. "
                       f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} "
                       f"in the {'messages' if chat else 'prompt'}, {max_tokens} in the "
                       "completion). Please reduce the length of the messages or completion.",
                       param=max_param)
    d = limits.defaults
    temperature = _given(request.temperature, d.temperature, 1.0)
    if request.n > limits.max_n:
        raise APIError(f"n must be at most {limits.max_n}", param="n")
    if request.n > 1 and temperature == 0.0:
        raise APIError("n > 1 needs temperature > 0: greedy choices would all be the same",
                       param="n")
    best_of = request.best_of
    if best_of is not None:
        if best_of < request.n:
            raise APIError(f"best_of ({best_of}) must be at least n ({request.n})",
                           param="best_of")
        if request.stream:
            raise APIError("best_of cannot be used with stream", param="best_of")
        if best_of > limits.max_n:
            raise APIError(f"best_of must be at most {limits.max_n}", param="best_of")
        if best_of > 1 and temperature == 0.0:
            raise APIError("best_of > 1 needs temperature > 0", param="best_of")
    if request.use_beam_search:
        raise APIError("beam search is not supported; use best_of", param="use_beam_search")
    if request.min_tokens > max_tokens:
        raise APIError(f"min_tokens ({request.min_tokens}) must not exceed {max_param} "
                       f"({max_tokens})", param="min_tokens")
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options needs stream: true", param="stream_options")
    if request.prompt_logprobs is not None:
        if request.stream:
            raise APIError("prompt_logprobs cannot be used with stream", param="prompt_logprobs")
        if request.prompt_logprobs == -1:
            # vLLM's -1: the whole vocabulary for every prompt token, past its max_logprobs
            raise APIError(f"prompt_logprobs -1 asks for the whole vocabulary "
                           f"({limits.vocab_size} entries) per prompt token; at most "
                           f"{MAX_LOGPROBS} are served", param="prompt_logprobs")
        if request.prompt_logprobs > MAX_LOGPROBS:
            raise APIError(f"prompt_logprobs must be at most {MAX_LOGPROBS}",
                           param="prompt_logprobs")
    if request.priority != 0 and not limits.priority_scheduling:
        raise APIError("priority needs a server started with priority scheduling "
                       "(--priority-scheduling)", param="priority")
    if request.suffix is not None:
        raise APIError("suffix is not supported: this model has no fill-in-the-middle mode",
                       param="suffix")
    if request.allowed_token_ids is not None:
        if not request.allowed_token_ids:
            raise APIError("allowed_token_ids must not be empty", param="allowed_token_ids")
        _check_ids(request.allowed_token_ids, limits.vocab_size, "allowed_token_ids")
    _check_ids(request.stop_token_ids or [], limits.vocab_size, "stop_token_ids")
    processors = []
    for p in request.logits_processors or []:
        name = p if isinstance(p, str) else str(p.get("qualname", ""))
        if name not in limits.logits_processors:
            raise APIError(f"logits processor {name!r} is not on this server's allowlist",
                           param="logits_processors")
        kwargs = {} if isinstance(p, str) else p.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError("logits processor kwargs must be an object", param="logits_processors")
        processors.append((name, json.dumps(kwargs, sort_keys=True)))

    logprobs_n: int | None = None
    top_logprobs = 0
    if chat and isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if request.logprobs:
            top_logprobs = request.top_logprobs or 0
            logprobs_n = top_logprobs
    elif request.logprobs is not None:  # completions: logprobs is the number of alternatives
        top_logprobs = request.logprobs
        logprobs_n = top_logprobs
    if best_of is not None and best_of > request.n and logprobs_n is None:
        logprobs_n = 0  # ranking the candidates needs each token's logprob
    prompt_logprobs = request.prompt_logprobs
    if not chat and request.echo and request.logprobs is not None:
        # as vLLM, the echoed prompt's tokens get logprobs too
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)

    bad_words = _bounded(_bad_words(request.bad_words, tokenizer))
    if request.allowed_token_ids is not None and set(request.allowed_token_ids) <= {
            w[0] for w in bad_words if len(w) == 1}:
        raise APIError("bad_words ban every token allowed_token_ids allows: nothing could be "
                       "generated", param="allowed_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature,
        top_p=_given(request.top_p, d.top_p, 1.0),
        top_k=max(0, _given(request.top_k, d.top_k, 0)),  # -1 and 0: no top-k
        min_p=_given(request.min_p, d.min_p, 0.0),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        # a prediction refuses penalties (it must match the draft): no model default then
        repetition_penalty=(request.repetition_penalty or 1.0)
        if getattr(request, "prediction", None)
        else _given(request.repetition_penalty, d.repetition_penalty, 1.0),
        logit_bias=_logit_bias(request.logit_bias, limits.vocab_size),
        allowed_token_ids=(tuple(request.allowed_token_ids)
                           if request.allowed_token_ids is not None else None),
        bad_words_token_ids=bad_words,
        seed=request.seed, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
        stop_token_ids=tuple(request.stop_token_ids or ()), logprobs=logprobs_n,
        prompt_logprobs=prompt_logprobs,
        logits_processors=tuple(processors))
    so = request.stream_options
    options = OutputOptions(
        stop=_stop_list(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        logprobs=logprobs_n is not None and (best_of is None or best_of == request.n
                                            or _asked_logprobs(request, chat)),
        top_logprobs=top_logprobs, echo=request.echo,
        return_token_ids=bool(request.return_token_ids),
        return_tokens_as_token_ids=bool(request.return_tokens_as_token_ids),
        stream=request.stream,
        include_usage=bool(request.stream and so is not None and so.include_usage),
        continuous_usage_stats=bool(request.stream and so is not None
                                    and so.continuous_usage_stats),
        best_of=best_of, length_penalty=request.length_penalty,
        timeout_s=request.inference_timeout)
    return params, options


def _asked_logprobs(request: SamplingFields, chat: bool) -> bool:
    if chat:
        return bool(getattr(request, "logprobs", False))
    return request.logprobs is not None  # type: ignore[attr-defined]
