"""Per-request chat templates in the sandbox's worker processes: the same text as transformers'
own rendering, and a 400 (never a hung or dead ingress) for a template that runs too long,
renders too much, asks for too much memory or fails; the workers recover after each."""

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

LOOP_1E10 = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "never")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_MODEL_ID))


@pytest.fixture(scope="module")
def sandbox():
    box = TemplateSandbox(processes=2, timeout_s=1.0, max_chars=10_000, max_memory_mb=512)
    yield box
    box.close()


async def test_renders_as_transformers_does(sandbox: TemplateSandbox, tokenizer) -> None:
    template = tokenizer.chat_template
    ours = await sandbox.render(MESSAGES, chat_template=template, add_generation_prompt=True,
                                **tokenizer.special_tokens_map)
    theirs = tokenizer.apply_chat_template(MESSAGES, chat_template=template,
                                           add_generation_prompt=True, tokenize=False)
    assert ours == theirs and "Hi there" in ours


async def test_a_1e10_iteration_template_is_a_400_within_its_limit(
        sandbox: TemplateSandbox) -> None:
    await sandbox.render(MESSAGES, chat_template="warm")  # the worker's start is not timed
    started = time.monotonic()
    with pytest.raises(APIError) as exc:
        await sandbox.render(MESSAGES, chat_template=LOOP_1E10)
    assert time.monotonic() - started < 2.0
    assert exc.value.status == 400 and exc.value.param == "chat_template"
    assert "longer than 1 s" in exc.value.message
    assert await sandbox.render(MESSAGES, chat_template="ok {{ messages[1].content }}") == \
        "ok Hi there"


async def test_the_event_loop_keeps_running_meanwhile(sandbox: TemplateSandbox) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
    ticker = asyncio.create_task(tick())
    results = await asyncio.gather(*(sandbox.render(MESSAGES, chat_template=LOOP_1E10)
                                     for _ in range(3)), return_exceptions=True)
    ticker.cancel()
    assert all(isinstance(r, APIError) for r in results)
    assert ticks > 50  # ~1 s of ticks: the loop was never blocked


@pytest.mark.parametrize("template, needle", [
    ("{{ 'x' * 20000 }}", "more than the 10000 allowed"),
    ("{{ 'x' * 10**10 }}", "memory"),
    ("{{ raise_exception('nope') }}", "nope"),
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
])
async def test_limits_and_errors_are_400s(sandbox: TemplateSandbox, template: str,
                                          needle: str) -> None:
    with pytest.raises(APIError) as exc:
        await sandbox.render(MESSAGES, chat_template=template)
    assert exc.value.status == 400 and exc.value.param == "chat_template"
    assert needle in exc.value.message, exc.value.message
    assert await sandbox.render(MESSAGES, chat_template="fine") == "fine"


async def test_untrusted_templates_are_refused_before_any_rendering(tokenizer) -> None:
    pre = Preprocessor(AppConfig())
    try:
        with pytest.raises(APIError) as exc:
            await pre.render(tokenizer, MESSAGES, chat_template=LOOP_1E10)
        assert exc.value.param == "chat_template" and "--trust-request-chat-template" in \
            exc.value.message
        assert pre.sandbox._idle == []  # no worker was ever started
        own = await pre.render(tokenizer, MESSAGES)  # the model's own template still renders
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert own.text == text and own.token_ids == tokenizer.encode(text, add_special_tokens=False)
    finally:
        pre.close()
