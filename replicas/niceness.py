"""A process's CPU priority on Linux: the engine core's, and the ingress's while it sheds a burst.

Ray starts its workers, and so every Serve replica, at niceness 15, below its own daemons (0).
The engine core sets itself to 5 (`ModelConfig.core_niceness`: a core at 15 is preempted mid-step
by every wake-up of the serving processes, and one preempted OpenMP thread stalls its team). The
ingress stays at 15 while it serves, so its per-token wake-ups wait for the core rather than
preempt it, and takes the core's niceness only while it refuses requests (`LoadPriority`): at 15
behind a busy core it got too little of the cores to shed a burst."""

from __future__ import annotations

import asyncio
import logging
import os
import time

logger = logging.getLogger(__name__)


def set_niceness(niceness: int | None, what: str) -> bool:
    """Every thread of this process so far to `niceness` (Linux keeps a niceness per thread;
    imports start some; threads started later take their creator's); None leaves them. Lowering
    a niceness needs CAP_SYS_NICE or RLIMIT_NICE: without them it stays as it is (logged, and
    False)."""
    if niceness is None:
        return True
    try:
        for task in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)
    except OSError as e:
        logger.warning("the %s stays at niceness %d (%s: %d wants CAP_SYS_NICE)", what,
                       os.getpriority(os.PRIO_PROCESS, 0), e.strerror, niceness)
        return False
    return True


class LoadPriority:
    """The ingress's niceness: as started (Ray's 15) while it serves, `niceness` from a refusal
    until `hold_s` after the last one. On a 2-core AVX2 Zen 3 box, 1,000 requests at once against
    a capacity of 12 were all answered after 3.4-4.0 s with the ingress at 5, 5.3-9.2 s at 15;
    held at 5 for good, one stream's TPOT was 26.6-29.8 ms against 26.3-26.9 at 15. Use from
    one event loop."""

    def __init__(self, niceness: int | None, hold_s: float = 2.0) -> None:
        self.niceness = niceness
        self.hold_s = hold_s
        self.base = os.getpriority(os.PRIO_PROCESS, 0)
        self.raised = False
        self._until = 0.0
        self._able = niceness is not None and niceness != self.base

    def refused(self) -> None:
        """A request was turned away for want of room."""
        if not self._able:
            return
        self._until = time.monotonic() + self.hold_s
        if self.raised:
            return
        if not set_niceness(self.niceness, "ingress"):
            self._able = False  # not permitted here: not tried again
            return
        self.raised = True
        asyncio.get_running_loop().call_later(self.hold_s, self._lower)

    def _lower(self) -> None:
        left = self._until - time.monotonic()
        if left > 0:
            asyncio.get_running_loop().call_later(left, self._lower)
            return
        set_niceness(self.base, "ingress")
        self.raised = False
