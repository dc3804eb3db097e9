"""set_niceness: every thread of the process, those started before the call included (Linux keeps
a niceness per thread), and those started after it take it too. In a child process: the suite's
own stays as it is."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, threading
from replicas.niceness import set_niceness
before = threading.Event()
threading.Thread(target=before.wait, daemon=True).start()
set_niceness(7, "test")
after = threading.Event()
threading.Thread(target=after.wait, daemon=True).start()
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}),
      len(os.listdir("/proc/self/task")))
set_niceness(None, "test")
print(os.getpriority(os.PRIO_PROCESS, 0))
"""


def test_every_thread_takes_the_niceness_and_none_leaves_it() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == "[7] 3", out  # the main thread and both others
    assert out[1] == "7"
