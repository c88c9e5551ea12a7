"""A running node slowed down from outside, for tests that change a node's speed mid-run (harness/pace.py
gives a node a speed of its own from its start, independent of how the cores are shared, and is what
benchmarks of mixed speeds use): a node's process may use 1/slowdown of a core's
time in every short period; once it has, it is paused (SIGSTOP) for the rest of the period and resumed
(SIGCONT). Only the harness does this, from outside the node: no flag or variable of the node slows it
down.

CPU time, not wall-clock time: a duty cycle of the wall clock gives a slow node 1/slowdown of whatever
share of a core it gets while it runs, and on a machine with more busy processes than cores (four nodes
on two) that share is itself small, so a "4x slower" node trained 13x fewer steps than the fast one
(benchmarks/deep.py's mixed row). Budgeted in CPU time, the speeds are what they say as long as the
cores can give the fast nodes theirs. A node waiting on the network uses no CPU and is not paused, as a
slow GPU does not slow its owner's network.

Only the node's own process is paused (its round loop, heartbeat and stream handlers); hivemind's DHT
and averager processes keep running, as they would on a busy machine whose owner took the GPU.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from diloco_node.procs import descendants

PERIOD = 0.2  # seconds of one budget-and-pause cycle: short against a round, long against a signal
POLL = 0.01  # how often the CPU time is read within a period (the kernel counts it in 10-ms ticks)
TICK = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user and system, all threads) the process has used; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK  # utime and stime, fields 14 and 15 of proc(5)


class Throttle:
    """Lets `pid` use 1/slowdown of each PERIOD in CPU time; `slowdown` may change while it runs (1:
    full speed)."""

    def __init__(self, pid: int, slowdown: float, period: float = PERIOD):
        if slowdown < 1:
            raise ValueError(f"slowdown must be >= 1, not {slowdown}")
        self.pid, self.slowdown, self.period = pid, slowdown, period
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True, name=f"throttle-{pid}")

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop pausing, and leave the process running."""
        self._done.set()
        self._thread.join()
        self._signal(signal.SIGCONT)

    def _cycle(self) -> None:
        credit = 0.0  # CPU seconds left over from (or, negative, overdrawn by) the periods before
        while not self._done.is_set():
            if self.slowdown <= 1:
                credit = 0.0
                if self._done.wait(self.period):
                    return
                continue
            end = time.monotonic() + self.period
            allowed = self.period / self.slowdown + credit
            used = self._run_until(allowed, end)
            if used is None:
                return
            # an overdraft (a poll's lag, the ticks' rounding) is paid back next period; time the node
            # left unused (waiting on the network) is not saved up for a burst later
            credit = max(-self.period, min(0.0, allowed - used)) if used >= allowed else 0.0
            left = end - time.monotonic()
            if left > 0 and used >= allowed:
                if not self._signal(signal.SIGSTOP):
                    return
                self._done.wait(left)
                if not self._signal(signal.SIGCONT):
                    return

    def _run_until(self, allowed: float, end: float) -> float | None:
        """Let the process run until it has used `allowed` CPU seconds or `end` comes; the seconds it
        used (None once it is gone)."""
        start = cpu_seconds(self.pid)
        if start is None:
            return None
        used = 0.0
        while used < allowed and not self._done.is_set():
            left = end - time.monotonic()
            if left <= 0:
                break
            self._done.wait(min(POLL, left))
            now = cpu_seconds(self.pid)
            if now is None:
                return None
            used = now - start
        return used

    def _signal(self, signum: int) -> bool:
        """False once the process is gone."""
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True


def freeze(pid: int, signum: int = signal.SIGSTOP) -> None:
    """Stop (or, with SIGCONT, resume) a node and every process under it: its hivemind helpers and
    p2pd too, as a machine that is suspended or swapping hard. A stopped node process alone would
    leave its averager answering matchmaking for it."""
    for each in (pid, *descendants(pid)):
        try:
            os.kill(each, signum)
        except ProcessLookupError:
            pass
