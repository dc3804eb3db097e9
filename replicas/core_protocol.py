"""The messages between a replica (the front) and its engine-core process.

Core -> front, msgpack (one `STEP` message per engine step, or per stream floor, carries every
request's new tokens and every failed request's error, as plain lists: no class names, no
per-object headers):
  [READY, info]            the model is loaded; `info` describes it (LLMServer.info)
  [STEP, rows, errors, ended]
                           rows: [request_id, TokenBatch fields...] (`batch_row`), which the
                           front forwards undecoded to the ingress of a channeled request
                           (replicas/channel.py); errors: [request_id, ...]; ended: the last
                           batches of requests whose rows the core sent their ingress itself
                           (a direct channel), which only end their `generate`
  [BEAT, stats]            every HEARTBEAT_S: the engine's counters and health (also a liveness
                           signal while a long forward runs on the core's compute thread)
  [STATS, token, stats]    the answer to a STATS command
Front -> core, pickle (requests carry their constraint specs and sampling parameters as frozen
dataclasses; one message holds every command issued in one turn of the front's event loop):
  [(ADD, GenerateRequest) | (ABORT, request_id) | (STOP, request_id, choice, kept)
   | (STATS, token) | (SHUTDOWN,) | (CONNECT, ingress, address) | (DISCONNECT, ingress)]
CONNECT and DISCONNECT open and close a direct channel: the core sends that ingress's requests'
rows to its socket (replicas/ingress_routes.py), as lists of `batch_row`s, one message per core
message (an ingress's socket also sits in a directory only this user can open).
Both ends live on one host and the sockets sit in a directory only this user can open."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack

from replicas.request import EngineError, TokenBatch, TokenLogprob

READY, STEP, BEAT, STATS, ADD, ABORT, STOP, SHUTDOWN, CONNECT, DISCONNECT = range(10)
HEARTBEAT_S = 0.5


def _lp(lp: TokenLogprob | None) -> list | None:
    if lp is None:
        return None
    return [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]] if lp.top else [
        lp.token_id, lp.logprob, lp.rank]


def _unlp(v: list | None) -> TokenLogprob | None:
    if v is None:
        return None
    top = tuple((int(a), float(b)) for a, b in v[3]) if len(v) > 3 else ()
    return TokenLogprob(v[0], v[1], v[2], top)


def batch_row(rid: str, b: TokenBatch) -> list:
    """A TokenBatch as a plain list: [request_id, choice, tokens, finish_reason, stop_reason,
    prompt tokens, cached tokens, accepted, rejected(, logprobs, prompt_logprobs)]."""
    row: list[Any] = [rid, b.choice_index, b.token_ids, b.finish_reason, b.stop_reason,
                      b.num_prompt_tokens, b.num_cached_tokens,
                      b.accepted_prediction_tokens, b.rejected_prediction_tokens]
    if b.logprobs is not None or b.prompt_logprobs is not None:
        row.append(None if b.logprobs is None else [_lp(x) for x in b.logprobs])
        row.append(None if b.prompt_logprobs is None else [_lp(x) for x in b.prompt_logprobs])
    return row


def row_batch(row: list) -> TokenBatch:
    """`batch_row`'s inverse (without the request id)."""
    lps = plps = None
    if len(row) > 9:
        lps = None if row[9] is None else tuple(_unlp(x) for x in row[9])
        plps = None if row[10] is None else tuple(_unlp(x) for x in row[10])
    return TokenBatch(row[1], tuple(row[2]), lps, row[3], row[4], row[5], row[6], plps,
                      accepted_prediction_tokens=row[7], rejected_prediction_tokens=row[8])


def encode_step(outputs: list[tuple[str, TokenBatch]],
                errors: list[tuple[str, BaseException]],
                ended: list[tuple[str, TokenBatch]] = ()) -> bytes:  # type: ignore[assignment]
    errs = []
    for rid, exc in errors:
        if isinstance(exc, EngineError):
            errs.append([rid, exc.message, exc.status, exc.param, exc.type, exc.retry_after])
        else:
            errs.append([rid, f"{type(exc).__name__}: {exc}", 500, None,
                         "InternalServerError", None])
    return msgpack.packb([STEP, [batch_row(rid, b) for rid, b in outputs], errs,
                          [batch_row(rid, b) for rid, b in ended]])


def decode_errors(errs: list) -> list[tuple[str, EngineError]]:
    return [(rid, EngineError(msg, status, param, type_, retry))
            for rid, msg, status, param, type_, retry in errs]


def encode(message: list) -> bytes:
    return msgpack.packb(message)


def decode(data: bytes) -> list:
    return msgpack.unpackb(data, use_list=True)


def encode_commands(commands: list[tuple]) -> bytes:
    return pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL)


def decode_commands(data: bytes) -> list[tuple]:
    return pickle.loads(data)  # noqa: S301  (from our own replica, over a private socket)
