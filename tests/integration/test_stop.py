"""Stopping a node the ways users do: Ctrl-C in a terminal (SIGINT to the process group) and
SIGTERM to the main pid (`kill`, `docker stop`, systemd), while it trains and while it is in the
middle of something. Each stop must exit 0 within its bound, print no traceback and leave no
helper process behind (NodeProcess.stop checks all three); a second Ctrl-C stops at once.

The situational stops (during matchmaking, with an eager exchange in flight, during a state
download) are in tests/system/test_stop_situations.py.
"""

from __future__ import annotations

import signal
import time

import pytest

from diloco_node.commands.launch import alive, descendants
from diloco_node.daemon.checkpoint import read_checkpoint
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

# README's promise: a stop takes at most 30 s plus the exchange in flight; a node that is only
# training has none.
STOP_BOUND = 30.0


def left_at(log: str, signal_name: str) -> int:
    """The round a node says it left at after `signal_name`: the stop it logs last."""
    stopped = log.rsplit(f"received {signal_name}; stopping", 1)
    assert len(stopped) == 2, f"no {signal_name} stop in the log:\n{log[-3000:]}"
    assert "left the swarm at round=" in stopped[1], log[-3000:]
    return int(stopped[1].split("left the swarm at round=")[1].split()[0])


def test_a_stopped_node_saves_and_resumes_where_it_stopped(spawn: NodeFactory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C, then a restart that resumes there, then SIGTERM: both stops save where they left
    (one node's life; the restart after a SIGTERM reads the checkpoint as after a Ctrl-C)."""
    node = spawn("a", "--inner-steps", "5")
    node.wait_for_round(2)
    node.stop("ctrl-c", within=STOP_BOUND)
    stopped_at = left_at(node.log_text(), "SIGINT")
    manifest = tmp_path / "a" / "itest" / "node.json"
    assert read_checkpoint(manifest)["round"] == stopped_at

    again = spawn("a", "--inner-steps", "5")
    assert again.wait_joined() == stopped_at
    # the identity kept in the checkpoint directory gives it the same peer id
    assert again.wait_for_address().split("/p2p/")[1] == node.wait_for_address().split("/p2p/")[1]
    assert f"resumed round={stopped_at}" in again.log_text()
    again.wait_for_round(stopped_at + 1)
    again.stop("sigterm", within=STOP_BOUND)
    stopped_again_at = left_at(again.log_text(), "SIGTERM")
    assert stopped_again_at >= stopped_at + 1
    assert read_checkpoint(manifest)["round"] == stopped_again_at


def test_a_second_ctrl_c_stops_at_once(spawn: NodeFactory) -> None:  # type: ignore[no-untyped-def]
    """A frozen peer holds the eager exchange in flight, so the first Ctrl-C waits to settle it;
    the second one ends the node at once, as a terminal user expects."""
    a = spawn("a", "--sync", "eager", "--inner-steps", "5", "--round-timeout", "120", "--sync-timeout", "120",
              "--min-peers", "2")
    b = spawn("b", "--sync", "eager", "--inner-steps", "5", "--round-timeout", "120", "--sync-timeout", "120",
              "--min-peers", "2", peer=a)
    b.wait_for_round(b.wait_joined() + 1)
    b.signal(signal.SIGSTOP)  # frozen: its heartbeat stops, its record stays live, a's exchange hangs
    try:
        a.wait_until(lambda: "exchange still running" in a.log_text() or a.status()["exchanging_round"] is not None,
                     60, "an exchange in flight")
        assert a.process is not None
        a.signal(signal.SIGINT)
        a.wait_until(lambda: "stopping at the next safe point" in a.log_text(), 10, "the first Ctrl-C")
        time.sleep(1)
        assert a.process.poll() is None, "the first Ctrl-C should wait for the exchange in flight"
        helpers = descendants(a.process.pid)
        started = time.monotonic()
        a.signal(signal.SIGINT)
        assert a.wait_exit(timeout=5) == 128 + signal.SIGINT
        assert time.monotonic() - started < 5
        assert "received SIGINT again; stopping now" in a.log_text()
        deadline = time.monotonic() + 10
        while [pid for pid in helpers if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in helpers if alive(pid)], "helper processes outlived the node"
    finally:
        b.signal(signal.SIGCONT)
