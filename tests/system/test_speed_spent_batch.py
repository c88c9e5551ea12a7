"""--speed-spent batch (docs/architecture.md §13) with two real nodes under blocking sync: both at
full speed, then one slowed to a quarter of its speed mid-run by the harness (harness/throttle.py).

What must hold: each node trains the run's H inner steps a round (never more; fewer only when a round
that started late reaches its deadline first), a faster node spending its speed on more batches per
step; once one is slowed, the other declares more tokens in each round they both trained H steps (its
batches per step, sized to the deadline), and the slowed node still contributes; both average
together every round and hold the same φ after it; the fast node's rounds stay T apart (it never
waits for the slowed one).
"""

from __future__ import annotations

import pytest

from harness.throttle import Throttle
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

T = 3.0
H = 4
ROUNDS = 7
OPTIONS = ("--round-seconds", str(T), "--speed-spent", "batch", "--inner-steps", str(H),
           "--max-outer-steps", str(ROUNDS), "--min-peers", "2", "--matchmaking-time", "1", "--round-timeout", "4")
FULL_SPEED = 2  # the last round both train at full speed; the slowdown starts as it ends
SLOWED = range(4, ROUNDS + 1)  # rounds trained wholly at a quarter of the speed
BATCH_TOKENS = 8 * 64  # FAST's --batch-size × --seq-len


def test_a_slowed_node_spends_fewer_batches_on_the_same_h_steps(spawn: NodeFactory) -> None:
    fast = spawn("fast", *OPTIONS, run_id="batch")
    slow = spawn("slow", *OPTIONS, run_id="batch", peer=fast)
    for node in (fast, slow):
        node.wait_joined()
    assert slow.process is not None
    throttle = Throttle(slow.process.pid, slowdown=1).start()
    try:
        slow.wait_for_round(FULL_SPEED)
        throttle.slowdown = 4  # a quarter of its speed from now on
        for node in (fast, slow):
            assert node.wait_exit(180) == 0, node.tail()
    finally:
        throttle.stop()
    logs = "\n".join(f"--- {node.name}:\n{node.log_text()[-3000:]}" for node in (fast, slow))
    ran, slowed = fast.rounds, slow.rounds
    assert sorted(ran) == list(range(1, ROUNDS + 1)), logs
    full = []  # rounds both trained the run's whole H
    for r in sorted(set(ran) & set(slowed)):
        assert ran[r].digest == slowed[r].digest, logs  # the same φ after every round both logged
        assert ran[r].group_size == slowed[r].group_size == 2, logs
        for node in (ran[r], slowed[r]):
            # at most H steps of at least one whole batch each (k is sized again before every step);
            # a round that started late may reach the deadline first, one too slow for a step skips
            assert node.skipped or (1 <= node.last_round_inner_steps <= H and node.last_round_tokens % BATCH_TOKENS == 0
                                    and node.last_round_tokens >= node.last_round_inner_steps * BATCH_TOKENS), logs
        if ran[r].last_round_inner_steps == slowed[r].last_round_inner_steps == H:
            full.append(r)
    assert 2 * len(full) >= ROUNDS, (full, logs)  # most rounds: every Δ covers the same H steps
    both = [r for r in SLOWED if r in full]
    assert both, logs  # the slowed node still contributed its H steps
    for r in both:  # the fast node accumulated more batches into each of its H steps
        assert ran[r].last_round_tokens >= 2 * slowed[r].last_round_tokens, (r, logs)
    periods = [(ran[r].time - ran[r - 1].time) / T for r in range(FULL_SPEED + 2, ROUNDS + 1)]
    assert all(abs(p - 1) < 0.3 for p in periods), (periods, logs)
