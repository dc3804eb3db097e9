"""Messages -> prompt token ids: memory strategy, content normalisation, chat template, truncation.

The model's own template renders here, in transformers' sandboxed Jinja environment
(`apply_chat_template`), on the ingress's preprocessing threads (serve_app/preprocess.py); a
request's own `chat_template` renders in a killable worker process (serve_app/template_sandbox.py).
Any template error is the client's 400."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.errors import APIError
from serve_app.multimodal import MEDIA_PARTS, MediaRef, media_ref
from serve_app.protocol import ChatCompletionRequest, Message, MemoryStrategy

TEXT_PARTS = {"text", "input_text", "output_text", "refusal", "thinking"}


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


def apply_memory_strategy(messages: list[Message], strategy: MemoryStrategy | None) -> list[Message]:
    """last_k keeps every system/developer message and the last k others, in order."""
    if strategy is None:
        return messages
    if strategy.name != "last_k":
        raise APIError(f"unknown memory strategy {strategy.name!r}; only 'last_k' is supported",
                       param="memory_strategy.name")
    if strategy.params is None:
        raise APIError("memory_strategy last_k needs params.k", param="memory_strategy.params")
    others = [i for i, m in enumerate(messages) if m.role not in ("system", "developer")]
    keep = set(others[-strategy.params.k:])
    return [m for i, m in enumerate(messages) if m.role in ("system", "developer") or i in keep]


def text_of(message: Message, index: int, skip_media: bool = False) -> str | None:
    """The message's text; a media part is a 400 (a text-only model) unless `skip_media`."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in MEDIA_PARTS and skip_media:
            continue
        if part.type in MEDIA_PARTS:
            raise APIError(f"content part type {part.type!r} is not supported: this model is "
                           "text-only", param=f"messages[{index}].content[{j}].type")
        if part.type not in TEXT_PARTS:
            raise APIError(f"unknown content part type {part.type!r}",
                           param=f"messages[{index}].content[{j}].type")
        text = part.text if part.text is not None else (part.refusal or part.thinking or "")
        texts.append(text)
    return "".join(texts)


def media_content(message: Message, index: int, modalities: frozenset[str],
                  refs: list[MediaRef]) -> str | list[dict[str, Any]]:
    """A message's content for a multimodal model's template: text, or parts where media parts
    become {"type": "image"} (what HF templates render as the placeholder), each one's source
    appended to `refs` in prompt order."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if part.type in MEDIA_PARTS:
            ref = media_ref(part, param, modalities)
            refs.append(ref)
            parts.append({"type": ref.modality})
        elif part.type in TEXT_PARTS:
            text = part.text if part.text is not None else (part.refusal or part.thinking or "")
            parts.append({"type": "text", "text": text})
        else:
            raise APIError(f"unknown content part type {part.type!r}", param=f"{param}.type")
    return parts


def to_template_messages(messages: list[Message], modalities: frozenset[str] = frozenset(),
                         refs: list[MediaRef] | None = None) -> list[dict[str, Any]]:
    """`modalities`: what the model takes besides text; its media parts' sources are appended
    to `refs`. A text-only model's messages render as plain text."""
    out = []
    for i, m in enumerate(messages):
        role = m.role
        if m.author is not None and "role" in m.author:
            role = str(m.author["role"])
        content = (media_content(m, i, modalities, refs) if modalities and refs is not None
                   else text_of(m, i) or "")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name:
            msg["name"] = m.name
        reasoning = m.reasoning_content or m.reasoning
        if reasoning:
            msg["reasoning_content"] = reasoning
        if m.tool_calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
                "name": tc.function.name, "arguments": _arguments(tc.function.arguments, i)}}
                for tc in m.tool_calls]
        if m.function_call is not None:  # the deprecated single-function form
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": m.function_call.name,
                "arguments": _arguments(m.function_call.arguments, i)}}]
        if role == "function":
            msg["role"] = "tool"
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _arguments(arguments: str | dict[str, Any], index: int) -> dict[str, Any] | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # templates render strings as they are
    return parsed if isinstance(parsed, dict) else arguments


def check_render_args(messages: list[dict[str, Any]], add_generation_prompt: bool,
                      continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                       param="continue_final_message")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise APIError("continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")


def template_variables(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's chat_template_kwargs, less the names the rendering itself owns."""
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "conversations", "tokenize", "chat_template", "tools",
                     "documents", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)
    return kwargs


def render(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
           documents: list[dict] | None = None, chat_template: str | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           add_special_tokens: bool = False, template_kwargs: dict[str, Any] | None = None
           ) -> RenderedPrompt:
    """The model's own template (blocking: run it on a preprocessing thread)."""
    check_render_args(messages, add_generation_prompt, continue_final_message)
    kwargs = template_variables(template_kwargs)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # jinja errors, sandbox violations, template raise_exception()
        raise APIError(f"chat template error: {type(exc).__name__}: {exc}",
                       param="chat_template" if chat_template else "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return RenderedPrompt(text, list(ids))


def render_args(request: ChatCompletionRequest, modalities: frozenset[str] = frozenset(),
                refs: list[MediaRef] | None = None) -> dict[str, Any]:
    """A chat request's rendering inputs, as `render` (or the template sandbox) takes them;
    with a multimodal model's `modalities`, the media parts' sources go to `refs`."""
    messages = to_template_messages(apply_memory_strategy(request.messages,
                                                          request.memory_strategy),
                                    modalities, refs)
    if not messages:
        raise APIError("no messages left after the memory strategy", param="memory_strategy")
    tools = None
    if request.tools and request.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in request.tools]
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return {"messages": messages, "tools": tools, "documents": request.documents,
            "chat_template": request.chat_template,
            "add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
            "add_special_tokens": bool(request.add_special_tokens), "template_kwargs": kwargs}


def truncate(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """Keeps the last k tokens (-1: the model's context length)."""
    if truncate_prompt_tokens is None:
        return ids
    k = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if k == 0:
        raise APIError("truncate_prompt_tokens must not be 0", param="truncate_prompt_tokens")
    return ids[-k:]
