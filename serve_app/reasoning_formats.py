"""How each model family writes its reasoning, by vLLM's `--reasoning-parser` names.

- `qwen3` (Qwen3, QwQ, SmolLM3): `<think>...</think>` at the start of the answer, or none (then
  the answer is all content); a prompt that opens `<think>` starts the answer inside it.
- `deepseek_r1` (DeepSeek R1 and its distills): the answer starts inside the reasoning whether
  or not it writes `<think>` (R1 templates open it in the prompt, older ones did not), unless the
  prompt closed it (thinking turned off); everything before `</think>` is reasoning."""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TURN_MARKERS = ("<|im_start|>", "<｜Assistant｜>")  # where the answer's turn begins


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the answer is reasoning until </think> even without <think>


FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("qwen3", starts_inside=False),
    ReasoningFormat("deepseek_r1", starts_inside=True),
)}


def detect(template: str | None, has_think_tokens: bool) -> ReasoningFormat | None:
    """The reasoning format of a chat template (or of a vocabulary with think tokens)."""
    t = template or ""
    if THINK_OPEN in t and "<｜Assistant｜>" in t:
        return FORMATS["deepseek_r1"]
    if THINK_OPEN in t or has_think_tokens:
        return FORMATS["qwen3"]
    return None


def think_state(prompt: str) -> str | None:
    """Whether the prompt's last turn leaves a <think> block "open" or "closed" for the
    answer, or has none (None)."""
    turn = prompt[max(0, *(prompt.rfind(m) for m in TURN_MARKERS)):]
    opened, closed = turn.rfind(THINK_OPEN), turn.rfind(THINK_CLOSE)
    if opened < 0 and closed < 0:
        return None
    return "open" if opened > closed else "closed"


def starts_in_reasoning(fmt: ReasoningFormat | None, prompt: str) -> bool:
    if fmt is None:
        return False
    state = think_state(prompt)
    return state == "open" or (fmt.starts_inside and state is None)
