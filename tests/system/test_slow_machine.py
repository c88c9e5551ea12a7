"""harness/throttle.py: an emulated slower machine gets its share of a core's time, measured in CPU
time, whatever else the cores are doing."""

from __future__ import annotations

import subprocess
import sys
import time

from harness.throttle import Throttle, cpu_seconds

BUSY = "while True: pass"


def test_a_throttled_process_uses_its_share_of_a_core_beside_busy_ones() -> None:
    """A 4x-slower process beside three full-speed busy ones (more than this machine's cores): it uses
    about a quarter of what a core would give it, not a quarter of its share of a crowded core."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(3)]
    slow = subprocess.Popen([sys.executable, "-c", BUSY])
    throttle = Throttle(slow.pid, slowdown=4).start()
    try:
        time.sleep(0.5)
        before, started = cpu_seconds(slow.pid), time.monotonic()
        time.sleep(3.0)
        after, elapsed = cpu_seconds(slow.pid), time.monotonic() - started
        assert before is not None and after is not None
        share = (after - before) / elapsed
        assert 0.17 <= share <= 0.3, share
        throttle.slowdown = 1  # full speed again: no longer held to the quarter
        time.sleep(0.3)
        before, started = cpu_seconds(slow.pid), time.monotonic()
        time.sleep(1.5)
        assert (cpu_seconds(slow.pid) or 0) - before > 0.3 * (time.monotonic() - started)
    finally:
        throttle.stop()
        for process in (*busy, slow):
            process.kill()
            process.wait()
    assert cpu_seconds(slow.pid) is None  # gone: the throttle's reader says so rather than raising
