"""The replica front's CPU per engine step, without Ray or a model: one step's STEP message from
the core (R requests, one token each) decoded, dispatched and sent on, for requests on a channel
(rows forwarded undecoded, one msgpack message) and for requests streaming over their own calls
(a TokenBatch per row, coalesced, pickled per request as Ray does); and what the ingress then
spends decoding the channel's message.

    python -m benchmarks.front --rows 1,32,256
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import time

from replicas import core_protocol as proto
from replicas.channel import Channel, decode
from replicas.core_client import Streams
from replicas.request import TokenBatch, coalesce


def _step(rows: int) -> bytes:
    outputs = [(f"chatcmpl-{i:032x}@0123456789ab", TokenBatch(0, (1234,), num_prompt_tokens=128))
               for i in range(rows)]
    return proto.encode_step(outputs, [])


async def _measure(rows: int, channeled: bool, steps: int) -> tuple[float, float]:
    """(front seconds per step, ingress seconds per step)."""
    streams = Streams()
    channel = Channel()
    boxes = []
    for i in range(rows):
        box = streams.open(f"chatcmpl-{i:032x}@0123456789ab")
        box.channel = channel if channeled else None
        boxes.append(box)
    wire = _step(rows)
    front = ingress = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        message = proto.decode(wire)
        streams.dispatch_rows(message[1], proto.decode_errors(message[2]))
        if channeled:
            sent = [pickle.dumps(await channel.take(), protocol=5)]
        else:  # each request's generate: take, coalesce, one Ray message each
            sent = [pickle.dumps(coalesce(await box.take()), protocol=5) for box in boxes]
        t1 = time.perf_counter()
        for data in sent:
            got = pickle.loads(data)  # noqa: S301 (our own bytes)
            if channeled:
                decode(got)
        ingress += time.perf_counter() - t1
        front += t1 - t0
    return front / steps, ingress / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32,256", help="requests in the step, comma-separated")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    print(f"{'rows':>5} {'path':>9} {'front ms/step':>14} {'us/row':>7} {'ingress ms/step':>16}")
    for rows in (int(r) for r in args.rows.split(",")):
        for channeled in (True, False):
            front, ingress = asyncio.run(_measure(rows, channeled, args.steps))
            print(f"{rows:>5} {'channel' if channeled else 'per-call':>9} {front * 1e3:>14.3f} "
                  f"{front / rows * 1e6:>7.2f} {ingress * 1e3:>16.3f}")


if __name__ == "__main__":
    main()
