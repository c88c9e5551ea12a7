"""A node's local ranks live and die with it (#13): a rank that dies takes the node down with one
line and a non-zero exit, the node resumes from its checkpoint, and a stop ends every rank."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from diloco_node.commands.launch import alive, descendants
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

FSDP = ["--parallel", "fsdp", "--local-ranks", "2", "--inner-steps", "5"]


def local_ranks(pid: int) -> list[int]:
    found = []
    for child in descendants(pid):
        try:
            if b"diloco_node.replica.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def test_a_dying_rank_takes_the_node_down_and_it_resumes(spawn: NodeFactory) -> None:
    node = spawn("fsdp", *FSDP)
    node.wait_for_round(2, timeout=180)
    assert node.process is not None
    (rank,) = local_ranks(node.process.pid)
    started = time.monotonic()
    os.kill(rank, signal.SIGKILL)
    code = node.wait_exit(timeout=60)
    took = time.monotonic() - started
    text = node.log_text()
    assert code == 1, text[-2000:]
    assert took < 40, f"took {took:.0f}s"
    assert "Traceback" not in text, text[-3000:]
    assert "local rank 1 exited with code -9" in text
    logged = max(node.rounds)

    again = spawn("fsdp", *FSDP)
    again.wait_joined(timeout=120)
    resumed = re.search(r"resumed round=(\d+)", again.log_text())
    # the last round logged, or the one before when the rank died while that round was being saved
    assert resumed and int(resumed[1]) in (logged, logged - 1), again.log_text()
    again.wait_for_round(int(resumed[1]) + 1, timeout=180)
    assert again.process is not None
    helpers = local_ranks(again.process.pid)
    assert len(helpers) == 1
    again.stop("sigterm", within=60)  # exit 0, in time, no traceback, no helper left
    assert not any(alive(pid) for pid in helpers)


def test_ctrl_c_stops_a_pipeline_node_and_its_ranks(spawn: NodeFactory) -> None:
    node = spawn("pipeline", "--parallel", "pipeline", "--local-ranks", "2", "--inner-steps", "5")
    node.wait_for_round(1, timeout=180)
    took = node.stop("ctrl-c", within=60)
    assert took < 30
    assert "left the swarm" in node.log_text()
