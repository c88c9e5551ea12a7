"""--round-seconds (docs/architecture.md §13) with two real nodes under blocking sync: both at full
speed, then one slowed down mid-run to a quarter of its speed by the harness (harness/throttle.py
pauses its process 3/4 of every 0.2 s), then frozen with all its processes (SIGSTOP) for longer than
a round.

What must hold: once slowed, the node trains fewer inner steps per round than before and than the
fast node, or, when not one of its steps fits before the deadline, skips the round (one log line)
and still takes the mean; it contributes in the rounds it is slowed, and the fast node's rounds stay
T apart (it never waits for the slowed one); both hold the same φ after every round; the frozen
node, once resumed, averages with the other again in its next round on the same φ, and the run
goes on to its end; rounds end on the shared deadlines, T apart once both run freely.
"""

from __future__ import annotations

import signal
import time

import pytest

from harness.throttle import Throttle, freeze
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

T = 3.0
ROUNDS = 7
FREEZE = 3.5 * T  # longer than a round, its barrier (T) and a lone matchmaking (at most --round-timeout)
OPTIONS = ("--round-seconds", str(T), "--max-outer-steps", str(ROUNDS), "--min-peers", "2",
           "--matchmaking-time", "1", "--round-timeout", "4")
TOGETHER = (1, 2, 3, 4)  # rounds before the freeze (the first: the nodes entered it at different times)
FULL_SPEED = 2  # the last round both train at full speed; the slowdown starts as it ends
SLOWED = 4  # a round trained wholly at a quarter of the speed


def test_fast_and_slowed_nodes_share_rounds_of_t_seconds_and_a_frozen_node_rejoins(spawn: NodeFactory) -> None:
    fast = spawn("fast", *OPTIONS, run_id="budget")
    slow = spawn("slow", *OPTIONS, run_id="budget", peer=fast)
    nodes = (fast, slow)
    for node in nodes:
        node.wait_joined()
    assert slow.process is not None
    throttle = Throttle(slow.process.pid, slowdown=1).start()  # 1: not paused yet
    try:
        slow.wait_for_round(FULL_SPEED)
        throttle.slowdown = 4  # its owner started a game: a quarter of its speed from now on
        fast.wait_for_round(TOGETHER[-1])
        slow.wait_for_round(TOGETHER[-1])
    finally:
        throttle.stop()
    freeze(slow.process.pid)
    stopped = time.time()
    time.sleep(FREEZE)
    freeze(slow.process.pid, signal.SIGCONT)
    resumed = time.time()
    for node in nodes:
        assert node.wait_exit(90) == 0, node.tail()
    logs = "\n".join(f"--- {node.name}:\n{node.log_text()[-3000:]}" for node in nodes)
    ran, slowed = fast.rounds, slow.rounds
    assert sorted(ran) == list(range(1, ROUNDS + 1)), logs

    assert set(TOGETHER) <= set(slowed), logs
    for r in sorted(set(ran) & set(slowed)):  # the same φ after every round both logged
        assert ran[r].digest == slowed[r].digest, logs
        assert ran[r].last_round_tokens == ran[r].last_round_inner_steps * 8 * 64, logs  # batch 8 × seq 64 (FAST)
    before = slowed[FULL_SPEED].last_round_inner_steps
    assert before > 0 and not slowed[FULL_SPEED].skipped, logs
    for r in range(FULL_SPEED + 1, TOGETHER[-1] + 1):
        # once slowed, the node trains fewer steps than before and than the fast one, or skips the
        # round and says so; both still average every round
        assert not ran[r].skipped and slowed[r].group_size == ran[r].group_size == 2, logs
        if slowed[r].skipped:
            assert slowed[r].loss is None and slowed[r].last_round_tokens == 0, logs
            assert f"round={r - 1} skipped: one inner step" in slow.log_text(), logs
    steps = slowed[SLOWED].last_round_inner_steps
    assert steps < before and steps < ran[SLOWED].last_round_inner_steps, logs
    assert any(not slowed[r].skipped for r in range(FULL_SPEED + 1, TOGETHER[-1] + 1)), logs  # it did contribute
    # the fast node never waited for the slowed one: its rounds stayed on the grid, T apart
    periods = [(ran[r].time - ran[r - 1].time) / T for r in range(FULL_SPEED + 1, TOGETHER[-1] + 1)]
    assert all(abs(p - 1) < 0.3 for p in periods), (periods, logs)
    # resumed, the frozen node averages with the other in its first round on the same φ, to the end;
    # woken after the run ended its round's inner phase, that first round trains nothing and takes
    # the other's mean at once (the group it counts is the contributors: the fast node alone)
    late = sorted(r for r, rec in slowed.items() if rec.time > resumed)
    caught = bool(late) and slowed[late[0]].skipped and \
        f"round={late[0] - 1} the run's inner phase of this round is over" in slow.log_text()
    assert late and all(slowed[r].group_size == 2 for r in late[1 if caught else 0:]), logs
    assert any(stopped < ran[r].time for r in ran), logs  # the run went on past the freeze
    # rounds end on the shared grid: T apart once both run freely again
    periods = [(ran[r].time - ran[r - 1].time) / T for r in late[1:]]
    assert periods and all(abs(p - 1) < 0.3 for p in periods), (periods, logs)
