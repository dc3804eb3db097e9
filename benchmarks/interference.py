"""Interferers: processes that take the CPU in short bursts, as the serving stack beside an engine
core does (each Ray worker wakes ~100 times a second, the ingress and the front once a message),
so `bench step --interferers` can measure what a step loses to them on a shared box.

A step on every core loses at least the CPU they take (`share`, of the whole box) where it is
compute-bound; a team whose threads wait for each other loses more, since a preempted thread holds
up the rest at the next barrier. The benchmark alternates blocks of steps with the interferers
paused (SIGSTOP) and running, so the box's drift falls on both sides alike."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

# a burst of `burst_s` of arithmetic, then sleep to the end of the period; niceness set first
_LOOP = """
import os, sys, time
os.nice(int(sys.argv[3]))
burst, period = float(sys.argv[1]), float(sys.argv[2])
x = 0
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < burst:
        x += 1
    time.sleep(max(0.0, period - (time.perf_counter() - t)))
"""


class Interferers:
    """`count` bursting processes, paused until `run`; a context manager that ends them."""

    def __init__(self, count: int, burst_s: float, period_s: float, nice: int = 0) -> None:
        if burst_s <= 0 or period_s <= burst_s:
            raise ValueError("an interferer's burst must be positive and shorter than its period")
        self.procs = [subprocess.Popen(
            [sys.executable, "-c", _LOOP, str(burst_s), str(period_s), str(nice)],
            stdin=subprocess.DEVNULL) for _ in range(count)]
        self._handles = [psutil.Process(p.pid) for p in self.procs]
        self._running_since: float | None = None
        self._cpu_at_start = 0.0
        self.running_s = 0.0  # wall time spent running
        self.cpu_s = 0.0  # their CPU time meanwhile
        time.sleep(0.2)  # past the interpreter's start, so it is not counted as a burst
        self.pause()
        self.running_s = self.cpu_s = 0.0

    def _cpu(self) -> float:
        total = 0.0
        for h in self._handles:
            t = h.cpu_times()
            total += t.user + t.system
        return total

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            os.kill(p.pid, sig)

    def run(self) -> None:
        if self._running_since is None:
            self._cpu_at_start = self._cpu()
            self._signal(signal.SIGCONT)
            self._running_since = time.perf_counter()

    def pause(self) -> None:
        if self._running_since is not None:
            self._signal(signal.SIGSTOP)
            self.running_s += time.perf_counter() - self._running_since
            self.cpu_s += self._cpu() - self._cpu_at_start
            self._running_since = None

    def share(self, since: tuple[float, float] = (0.0, 0.0)) -> float:
        """Their CPU while running (since a `mark`), as a fraction of every core of the box."""
        cpu, running = self.cpu_s - since[0], self.running_s - since[1]
        return cpu / (running * (os.cpu_count() or 1)) if running > 0 else 0.0

    def mark(self) -> tuple[float, float]:
        return self.cpu_s, self.running_s

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()

    def __enter__(self) -> Interferers:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
