"""A slower machine, emulated for tests and benchmarks: a node's process is paused (SIGSTOP) for part
of every short period and resumed (SIGCONT), so it computes at 1/slowdown of its speed. Only the
harness does this, from outside the node: no flag or variable of the node slows it down.

Only the node's own process is paused (its round loop, heartbeat and stream handlers); hivemind's DHT
and averager processes keep running, as they would on a busy machine whose owner took the GPU.
"""

from __future__ import annotations

import os
import signal
import threading

from diloco_node.procs import descendants

PERIOD = 0.2  # seconds of one pause-and-run cycle: short against a round, long against a signal


class Throttle:
    """Runs `pid` 1/slowdown of each PERIOD; `slowdown` may change while it runs (1: full speed)."""

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
        while not self._done.is_set():
            running = self.period / self.slowdown
            if self._done.wait(running):
                return
            if self.slowdown > 1:
                if not self._signal(signal.SIGSTOP):
                    return
                self._done.wait(self.period - running)
                if not self._signal(signal.SIGCONT):
                    return

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
