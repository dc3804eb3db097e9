"""set_niceness: every thread of the process, those started before the call included (Linux keeps
a niceness per thread), and those started after it take it too. LoadPriority: the core's niceness
from a refusal until its hold after the last one, then back. In child processes: the suite's own
stays as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

THREADS = """
import os, threading
from replicas.niceness import set_niceness
before = threading.Event()
threading.Thread(target=before.wait, daemon=True).start()
assert set_niceness(7, "test")
after = threading.Event()
threading.Thread(target=after.wait, daemon=True).start()
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}),
      len(os.listdir("/proc/self/task")))
set_niceness(None, "test")
print(os.getpriority(os.PRIO_PROCESS, 0))
"""

LOAD = """
import asyncio, os
from replicas.niceness import LoadPriority
os.nice(15 - os.nice(0))  # as Ray starts its workers

async def main():
    p = LoadPriority(5, hold_s=0.4)
    now = lambda: os.getpriority(os.PRIO_PROCESS, 0)
    seen = [now()]
    p.refused()
    seen.append(now())
    await asyncio.sleep(0.3)
    p.refused()  # the hold runs from the last refusal
    await asyncio.sleep(0.3)
    seen.append(now())
    await asyncio.sleep(0.4)
    seen.append(now())
    p.refused()  # a later burst raises it again
    seen.append(now())
    print(seen)

asyncio.run(main())
"""


def _run(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split("\n")


def test_every_thread_takes_the_niceness_and_none_leaves_it() -> None:
    out = _run(THREADS)
    assert out[0] == "[7] 3", out  # the main thread and both others
    assert out[1] == "7"


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a niceness needs CAP_SYS_NICE")
def test_a_refusal_raises_the_priority_until_the_hold_after_the_last_one() -> None:
    assert _run(LOAD)[0] == "[15, 5, 5, 15, 5]"
