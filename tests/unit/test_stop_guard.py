"""A stop that arrives while start-up is stuck in C code (lifecycle.StopSignals): Python runs signal
handlers between bytecodes only, so a main thread that never returns to the interpreter would keep
the node running for good; the stop guard ends it with exit 1 after the grace. After start-up the
round loop acts on stops itself and the guard stays out of the way."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

STUCK = """
import ctypes, sys
from diloco_node.daemon import lifecycle
lifecycle.STARTUP_STOP_GRACE = 1.0
signals = lifecycle.StopSignals()
signals.install()
signals.starting = sys.argv[1] == "starting"
print("ready", flush=True)
libc = ctypes.CDLL(None)
for _ in range(2):  # stuck in C code, the stop request set but never acted on (4 s in all)
    libc.sleep(2)
print("requested" if signals.requested.is_set() else "not requested", flush=True)
"""


def stopped_while(phase: str) -> tuple[int, float, str, str]:
    node = subprocess.Popen([sys.executable, "-c", STUCK, phase], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert node.stdout is not None and node.stdout.readline() == "ready\n"
    sent = time.monotonic()
    node.send_signal(signal.SIGTERM)
    out, err = node.communicate(timeout=30)
    return node.returncode, time.monotonic() - sent, out, err


def test_a_stop_during_a_stuck_start_up_ends_the_node_with_exit_1_after_the_grace() -> None:
    code, seconds, _, err = stopped_while("starting")
    assert code == 1 and seconds < 6, (code, seconds, err)
    assert err.strip().splitlines() == ["diloco-node: stop signal received during start-up, which has not ended 1s "
                                        "later; ending it"], err


def test_after_start_up_the_guard_leaves_the_stop_to_the_node() -> None:
    code, seconds, out, err = stopped_while("running")
    assert (code, out.strip().splitlines()[-1]) == (0, "requested"), (code, out, err)
