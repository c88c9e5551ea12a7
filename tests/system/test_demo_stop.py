"""`diloco-node demo` stopped at any moment, by Ctrl-C (SIGINT to its process group, as a terminal
sends it) or SIGTERM, leaves no process behind: its nodes run in sessions of their own, so the
demo must pass the stop on to each (diloco_node/commands/demo.py). Every process of the demo's tree is
tracked from start to exit, since an orphan is no longer the demo's descendant once it exits.
The stop mid-run is in test_demo_stop_mid_run.py (each file stays under a minute).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco_node.commands.launch import alive, descendants
from diloco_node.procs import program

pytestmark = pytest.mark.integration

DEMO_EXIT_BOUND = 90.0  # the nodes' stop (README: 30 s plus the exchange in flight) and the summary
AFTERMATH = 10.0  # what a helper gets to go after its node exited (as NodeProcess.stop allows)


def stop_demo_when(reached: Callable[[list[int], str], bool], how: str, output: Path, timeout: float = 120) -> None:
    """Start a demo printing to `output`; once `reached(its processes, what it printed)` holds, stop
    it `how`; then no process of its tree may remain."""
    # SIGINT as a shell leaves it for a foreground job: a disposition of SIG_IGN in this process (as
    # hivemind leaves it in a process that starts an averager) is inherited, and a Ctrl-C before the
    # demo installs its handler was then lost: the demo trained on for 90 s (seen in the system tier)
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        with output.open("w") as sink:
            demo = subprocess.Popen([sys.executable, "-m", "diloco_node", "demo", "--nodes", "2", "--rounds", "100",
                                     "--inner-steps", "5"], stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own group, as a shell's foreground job
    finally:
        signal.signal(signal.SIGINT, previous)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + timeout
        while not reached(tree := descendants(demo.pid), output.read_text()):
            seen.update(tree)
            assert demo.poll() is None, "the demo exited by itself"
            assert time.monotonic() < deadline, f"moment not reached: {[program(p) for p in tree]}"
            time.sleep(0.05)
        seen.update(tree)
        if how == "ctrl-c":
            os.killpg(demo.pid, signal.SIGINT)
        else:
            demo.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + DEMO_EXIT_BOUND
        while demo.poll() is None:  # nodes started while it stops are tracked too
            seen.update(descendants(demo.pid))
            assert time.monotonic() < deadline, \
                f"the demo did not exit within {DEMO_EXIT_BOUND:.0f}s of {how}; it printed:\n" \
                f"{output.read_text()[-3000:]}\nits processes: {[program(p) for p in descendants(demo.pid)]}"
            time.sleep(0.05)
        deadline = time.monotonic() + AFTERMATH
        while [pid for pid in seen if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [(pid, program(pid)) for pid in seen if alive(pid)]
        assert not survivors, f"processes of the demo outlived it: {survivors}"
    finally:
        for pid in [demo.pid, *seen]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)  # only after the assertion above has failed
        demo.wait()


def p2pds(tree: list[int]) -> int:
    return sum(program(pid) == "p2pd" for pid in tree)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stopped_at_once(how: str, tmp_path: Path) -> None:
    stop_demo_when(lambda tree, printed: True, how, tmp_path / "demo.out")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stopped_while_its_first_node_starts_its_swarm(how: str, tmp_path: Path) -> None:
    stop_demo_when(lambda tree, printed: p2pds(tree) >= 1, how, tmp_path / "demo.out")
