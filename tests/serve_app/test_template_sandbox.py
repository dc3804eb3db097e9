"""Per-request chat templates in the sandbox's worker processes: the same text as transformers'
own rendering, and a 400 (never a hung or dead ingress) for a template that runs too long,
renders too much, asks for too much memory or fails; the workers recover after each, a flood
turns into prompt 503s, and one client cannot hold every worker."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from replicas.embedded import EMBEDDED_MODEL_ID
from replicas.model_files import resolve_model_path
from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.preprocess import Preprocessor
from serve_app.template_sandbox import TemplateSandbox

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMIT_S = 1.0
LOOP_1E10 = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "never")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_MODEL_ID))


@pytest.fixture(scope="module")
def sandbox():
    box = TemplateSandbox(processes=2, timeout_s=LIMIT_S, max_chars=10_000, max_memory_mb=512)
    box.start()
    yield box
    box.close()


async def render(sandbox: TemplateSandbox, template: str, **kwargs) -> str:
    return await sandbox.render(MESSAGES, chat_template=template, **kwargs)


async def warm(sandbox: TemplateSandbox) -> None:
    """Until both workers have started (the replacements of those a test before killed too; on a
    busy box a start can take longer than the 1 s limit) and answer."""
    for _ in range(30):
        results = await asyncio.gather(render(sandbox, "warm"), render(sandbox, "warm"),
                                       return_exceptions=True)
        if results == ["warm", "warm"] and sandbox.wait_started(30.0):
            return
    raise AssertionError(results)


async def test_renders_as_transformers_does(sandbox: TemplateSandbox, tokenizer) -> None:
    # the workers' first start (importing jinja2 and transformers' template code) can take more
    # than the 1 s limit on a slow box with the suite beside it
    await warm(sandbox)
    template = tokenizer.chat_template
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": True, "tools": TOOLS},
                   {"add_generation_prompt": False, "continue_final_message": True,
                    "messages": MESSAGES + [{"role": "assistant", "content": "Sure, so"}]}):
        messages = kwargs.pop("messages", MESSAGES)
        ours = await sandbox.render(messages, chat_template=template,
                                    variables=tokenizer.special_tokens_map, **kwargs)
        theirs = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                               **kwargs)
        assert ours == theirs and "Hi there" in ours


async def test_variables_reach_the_template(sandbox: TemplateSandbox) -> None:
    text = await render(sandbox, "{{ eos_token }}|{{ flavour }}|{{ messages | length }}",
                        variables={"eos_token": "<e>", "flavour": "mint"})
    assert text == "<e>|mint|2"


async def test_a_1e10_iteration_template_is_a_400_within_its_limit(
        sandbox: TemplateSandbox) -> None:
    await warm(sandbox)
    started = time.monotonic()
    with pytest.raises(APIError) as exc:
        await render(sandbox, LOOP_1E10)
    assert time.monotonic() - started < LIMIT_S + 1.0
    assert exc.value.status == 400 and exc.value.param == "chat_template"
    assert "longer than 1 s" in exc.value.message
    assert await render(sandbox, "ok {{ messages[1].content }}") == "ok Hi there"


async def test_the_event_loop_keeps_running_meanwhile(sandbox: TemplateSandbox) -> None:
    await warm(sandbox)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
    ticker = asyncio.create_task(tick())
    results = await asyncio.gather(*(render(sandbox, LOOP_1E10) for _ in range(2)),
                                   return_exceptions=True)
    ticker.cancel()
    assert all(isinstance(r, APIError) and r.status == 400 for r in results), results
    assert ticks > 50  # ~1 s of ticks: the loop was never blocked


async def test_a_flood_is_answered_within_the_limit(sandbox: TemplateSandbox) -> None:
    """Six runaway templates on two workers: two run out of time (400), the rest find no worker
    free in time (503 + Retry-After); nobody waits past the limit."""
    await warm(sandbox)
    started = time.monotonic()
    results = await asyncio.gather(*(render(sandbox, LOOP_1E10) for _ in range(6)),
                                   return_exceptions=True)
    assert time.monotonic() - started < LIMIT_S + 1.0
    assert sorted(r.status for r in results) == [400, 400, 503, 503, 503, 503], results
    busy = [r for r in results if r.status == 503]
    assert all(r.retry_after and "busy" in r.message for r in busy)
    await warm(sandbox)  # both workers were killed: their replacements take over


async def test_one_client_cannot_hold_every_worker(sandbox: TemplateSandbox) -> None:
    """Client a's runaway templates take turns in one worker; client b renders meanwhile."""
    await warm(sandbox)
    flood = [asyncio.create_task(render(sandbox, LOOP_1E10, client="a")) for _ in range(3)]
    await asyncio.sleep(0.2)
    started = time.monotonic()
    assert await render(sandbox, "b's turn", client="b") == "b's turn"
    assert time.monotonic() - started < 0.5
    results = await asyncio.gather(*flood, return_exceptions=True)
    # a's first ran out of time; its others waited for a's turn until their own limit
    assert sorted(r.status for r in results) == [400, 503, 503], results
    assert sandbox._lanes == {}  # a line is gone with its last request


async def test_output_is_cut_at_the_limit_as_it_streams(sandbox: TemplateSandbox) -> None:
    """10^10 characters, printed ten at a time: the limit stops it long before the time limit
    (rendering it whole would take hours, or all the worker's memory)."""
    await warm(sandbox)
    started = time.monotonic()
    with pytest.raises(APIError) as exc:
        await render(sandbox, "{% for i in range(100000) %}{% for j in range(100000) %}"
                              "0123456789{% endfor %}{% endfor %}")
    assert time.monotonic() - started < LIMIT_S / 2
    assert exc.value.status == 400 and exc.value.param == "chat_template"
    assert "more than the 10000 characters allowed" in exc.value.message


@pytest.mark.parametrize("template, needle", [
    ("{{ 'x' * 20000 }}", "more than the 10000 characters allowed"),
    ("{{ 'x' * 10**10 }}", "memory"),
    ("{{ raise_exception('nope') }}", "nope"),
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
])
async def test_limits_and_errors_are_400s(sandbox: TemplateSandbox, template: str,
                                          needle: str) -> None:
    with pytest.raises(APIError) as exc:
        await render(sandbox, template)
    assert exc.value.status == 400 and exc.value.param == "chat_template"
    assert needle in exc.value.message, exc.value.message
    assert await render(sandbox, "fine") == "fine"


async def test_untrusted_templates_are_refused_before_any_rendering(tokenizer) -> None:
    pre = Preprocessor(AppConfig())
    try:
        with pytest.raises(APIError) as exc:
            await pre.render(tokenizer, MESSAGES, chat_template=LOOP_1E10)
        assert exc.value.status == 400 and exc.value.param == "chat_template"
        assert "--trust-request-chat-template" in exc.value.message
        assert pre.sandbox._idle == []  # no worker was ever started
        own = await pre.render(tokenizer, MESSAGES)  # the model's own template still renders
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert own.text == text and own.token_ids == tokenizer.encode(text, add_special_tokens=False)
    finally:
        pre.close()


async def test_trusted_templates_render_and_tokenize_as_the_models_own(tokenizer) -> None:
    pre = Preprocessor(AppConfig(trust_request_chat_template=True))
    try:
        kwargs = {"tools": TOOLS, "template_kwargs": {"reasoning_effort": "low"}}
        own = await pre.render(tokenizer, MESSAGES, **kwargs)
        for _ in range(10):  # the workers start with the Preprocessor: 503s until they have
            try:
                sent = await pre.render(tokenizer, MESSAGES, chat_template=tokenizer.chat_template,
                                        client="addr:127.0.0.1", **kwargs)
                break
            except APIError as exc:
                assert exc.status == 503, exc.message
        assert sent == own and "Reasoning effort: low" in sent.text
    finally:
        pre.close()
