"""The per-request measurement record: produced by ``client``, summarised by ``metrics``,
serialised by ``serve`` and read back by ``plot``. Times are seconds."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RequestOutcome:
    """What one request did, as measured on the client side.

    ``start_time`` is a ``time.perf_counter()`` stamp while in flight; the runner rebases it to
    seconds since the benchmark started before writing results.
    """

    success: bool
    prompt_len: int
    output_tokens: int
    expected_output_len: int
    ttft: float = 0.0
    # One entry per output token after the first; a chunk carrying k tokens contributes k
    # equal parts of its gap, so sum(itl) == time from first to last content chunk.
    itl: tuple[float, ...] = ()
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""
    # True when output/prompt token counts came from the server's usage report rather than
    # from counting content chunks (which undercounts when chunks carry several tokens).
    usage_reported: bool = False
    # Dataset label of the request (e.g. "random", "structured:regex").
    kind: str = ""
    # The gaps between consecutive content chunks as they arrived, whatever each carried: what
    # a reader of the stream sees (vllm bench serve's ITL). A server that groups tokens into
    # fewer events has long event gaps under a short `itl`.
    event_gaps: tuple[float, ...] = ()

    @property
    def tpot(self) -> float | None:
        """Time per output token excluding the first, or None when fewer than two tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl"] = list(self.itl)
        data["event_gaps"] = list(self.event_gaps)
        data["tpot"] = self.tpot
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOutcome:
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["itl"] = tuple(kwargs.get("itl", ()))
        kwargs["event_gaps"] = tuple(kwargs.get("event_gaps", ()))
        return cls(**kwargs)
