"""Pydantic models of the OpenAI/vLLM API surface: requests, responses, stream chunks, errors.

Requests accept unknown fields and ignore them (as vLLM does); a known field with a wrong type or
value is a 400 that names the field. Cross-field rules live in `sampling.py`, which turns a request
into engine parameters; aliases resolve there, in one place.

Every list a request hands over has a cap (the `MAX_*` constants): the engine applies the sampling
lists on every step, which all rows of the batch wait for, and the ingress checks stop strings on
every token, so an unbounded list would slow everyone's stream, not only its own."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from serve_app.errors import APIError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Caps on what a request lists (sources in the README's limits table)
MAX_STOP = 32  # stop strings (OpenAI: 4; vLLM: VLLM_MAX_STOP_STRINGS, 4 by default, raisable)
MAX_STOP_CHARS = 128  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # vLLM: VLLM_MAX_NUM_BAD_WORDS
MAX_BAD_WORD_CHARS = 128
MAX_BAD_WORDS_TOKENS = 2048  # all bad words' tokens, both spellings (vLLM: 1024, one spelling)
MAX_LOGIT_BIAS = 1024  # OpenAI
MAX_ALLOWED_TOKEN_IDS = 262_144  # the largest common vocabulary (Gemma 3's): any allowlist fits
MAX_LOGITS_PROCESSORS = 16
MAX_MESSAGES = 2048  # (Azure) OpenAI
MAX_TOOLS = 128  # OpenAI
MAX_PROMPTS = 1024  # a completions request's prompt list (vLLM: VLLM_MAX_COMPLETION_PROMPTS)


class _Open(BaseModel):
    # NaN and ±Infinity (which Python's json accepts) are no valid value of any request field
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)


def _param_path(path: list[str | int]) -> str | None:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _reject_unencodable(body: Any) -> Any:
    """A lone surrogate (valid JSON "\\ud800", but no text) cannot be tokenized: a 400 that
    names the field, not a 500 from the tokenizer. Iterative: depth was checked before."""
    def check(text: str, path: tuple[str | int, ...]) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("the string contains a lone UTF-16 surrogate, which is not valid "
                           "Unicode text", param=_param_path(list(path))) from None

    containers = (str, dict, list)
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            check(node, path)
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str):
                    check(k, path)
                if isinstance(v, containers):
                    stack.append((v, (*path, str(k))))
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node) if isinstance(v, containers))
    return body


def too_many(limit: int, noun: str, count: int) -> PydanticCustomError:
    return PydanticCustomError("too_many", "at most {limit} {noun} per request, got {count}",
                               {"limit": limit, "noun": noun, "count": count})


def at_most(limit: int, noun: str) -> BeforeValidator:
    """Counts a list (or object) before its items are parsed, so an oversized one costs little:
    a 400 that names the field, the limit and what was sent."""
    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise too_many(limit, noun, len(value))
        return value
    return BeforeValidator(check)


def _too_long(field: str, value: str | list[str], limit: int) -> None:
    for i, item in enumerate([value] if isinstance(value, str) else value):
        if len(item) > limit:
            where = field if isinstance(value, str) else f"{field}[{i}]"
            raise PydanticCustomError(
                "too_long", "{where} has {length} characters, at most {limit} are allowed",
                {"where": where, "length": len(item), "limit": limit})


def _prompt_count(value: Any) -> Any:
    # a list of token ids is one prompt; a list of strings or of id lists is one prompt each
    if (isinstance(value, list) and len(value) > MAX_PROMPTS
            and not all(isinstance(x, int) for x in value)):
        raise too_many(MAX_PROMPTS, "prompts", len(value))
    return value


class _Request(_Open):
    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        return _reject_unencodable(data)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# ---- messages ----------------------------------------------------------------------------------
class ContentPart(_Open):
    type: str
    text: str | None = None
    refusal: str | None = None
    thinking: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _simple_media_form(cls, data: Any) -> Any:
        """The untyped {"image_url": "..."} form (also audio_url, video_url) names its type by
        its one media field."""
        if isinstance(data, dict) and "type" not in data:
            for field in ("image_url", "audio_url", "video_url"):
                if field in data:
                    return {**data, "type": field}
        return data


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    function_call: FunctionCall | None = None
    # the harmony-style Message{author, channel, content, recipient} form
    author: dict[str, Any] | None = None
    channel: str | None = None
    recipient: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _role_from_author(cls, data: Any) -> Any:
        """The harmony form names its role as author.role: {"author": {"role": "user"}, ...}."""
        if isinstance(data, dict) and "role" not in data and isinstance(data.get("author"), dict):
            role = data["author"].get("role")
            if isinstance(role, str):
                return {**data, "role": role}
        return data


# ---- tools -------------------------------------------------------------------------------------
class FunctionDefinition(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


# ---- structured outputs ------------------------------------------------------------------------
class JsonSchemaFormat(_Open):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag form (vLLM): {"type": "structural_tag", "structures": [...], "triggers": [...]}
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputs(_Open):
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    backend: str | None = None


class StreamOptions(_Open):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class MemoryStrategyParams(_Open):
    k: int = Field(ge=1)


class MemoryStrategy(_Open):
    name: str
    params: MemoryStrategyParams | None = None


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]


class SamplingFields(_Request):
    """The sampling and output fields /v1/chat/completions and /v1/completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: float | None = Field(None, gt=0.0)
    length_penalty: float = 1.0
    logit_bias: Annotated[dict[str, float] | None,
                          at_most(MAX_LOGIT_BIAS, "logit_bias entries")] = None
    allowed_token_ids: Annotated[list[TokenId] | None,
                                 at_most(MAX_ALLOWED_TOKEN_IDS, "allowed token ids")] = None
    bad_words: Annotated[list[str] | None, at_most(MAX_BAD_WORDS, "bad words")] = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Annotated[str | list[str] | None, at_most(MAX_STOP, "stop strings")] = None
    stop_token_ids: Annotated[list[TokenId] | None,
                              at_most(MAX_STOP_TOKEN_IDS, "stop token ids")] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    prompt_logprobs: int | None = Field(None, ge=-1)
    echo: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    logits_processors: Annotated[list[str | dict[str, Any]] | None,
                                 at_most(MAX_LOGITS_PROCESSORS, "logits processors")] = None
    priority: int = 0
    # echoed in the X-Request-Id header: visible ASCII only (a header cannot carry the rest)
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    cache_salt: str | None = None
    user: str | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    suffix: str | None = None
    inference_timeout: float | None = Field(None, gt=0)
    inference_extra_params: dict[str, Any] | None = None
    inference_extra_headers: dict[str, Any] | None = None
    use_beam_search: bool = False

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        _too_long("stop", v or [], MAX_STOP_CHARS)
        return v

    @field_validator("bad_words")
    @classmethod
    def _no_empty_bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not w.strip() for w in v):
            raise ValueError("bad words must be non-empty strings")
        _too_long("bad_words", v or [], MAX_BAD_WORD_CHARS)
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string")
        return v


Messages = Annotated[list[Message], at_most(MAX_MESSAGES, "messages")]
Tools = Annotated[list[Tool] | None, at_most(MAX_TOOLS, "tools")]


class ChatCompletionRequest(SamplingFields):
    # the /openapi.json example (the docs page shows it; API fuzzers start from it)
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "model": "shardserve/tiny-llama", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16}]})
    messages: Messages = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Tools = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    memory_strategy: MemoryStrategy | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "model": "shardserve/tiny-llama", "prompt": "Once upon a time", "max_tokens": 16}]})
    prompt: Annotated[str | list[str] | list[int] | list[list[int]],
                      BeforeValidator(_prompt_count)]
    logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "model": "shardserve/tiny-llama", "messages": [{"role": "user", "content": "Hello"}]}]})
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: Tools = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "model": "shardserve/tiny-llama", "tokens": [1, 2, 3]}]})
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ---------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    # Predicted Outputs: prediction tokens that appeared in the output / that did not. Unlike
    # OpenAI, rejected ones are not in completion_tokens, which counts the tokens returned
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaToolCallFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaToolCallFunction | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shardserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
