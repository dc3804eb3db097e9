"""A process's CPU priority on Linux: the engine core's and the HTTP front's (ingress, /health).

Ray starts its workers, and so every Serve replica, at niceness 15, below its own daemons (0).
The engine core sets itself to 5 (`ModelConfig.core_niceness`: a core at 15 is preempted mid-step
by every wake-up of the serving processes, and one preempted OpenMP thread stalls its team); the
ingress and /health then set themselves to the same (`AppConfig.front_niceness`): left at 15
behind a busy core they got too little of the cores to shed a burst."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def set_niceness(niceness: int | None, what: str) -> None:
    """Every thread of this process so far to `niceness` (Linux keeps a niceness per thread;
    imports start some; threads started later take their creator's); None leaves them. Lowering
    a niceness needs CAP_SYS_NICE or RLIMIT_NICE: without them it stays as it is (logged)."""
    if niceness is None:
        return
    try:
        for task in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)
    except OSError as e:
        logger.warning("the %s stays at niceness %d (%s: %d wants CAP_SYS_NICE)", what,
                       os.getpriority(os.PRIO_PROCESS, 0), e.strerror, niceness)
