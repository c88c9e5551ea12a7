"""Two real nodes through the real CLI that several tests read: the status API, and a late joiner.

One pair (a module-scoped fixture, killed after this module) serves both tests instead of one pair
each. The tests run in file order: the status test counts 2 peers before the late joiner comes.
"""

from __future__ import annotations

import pytest

from diloco_node.commands.launch import NodeProcess
from tests.integration.conftest import NodeFactory
from tests.integration.test_swarm import log_tails

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(spawn_shared: NodeFactory) -> tuple[NodeProcess, NodeProcess]:
    """Two nodes training together without end; test_late_joiner_reaches_the_same_digest adds a third."""
    first = spawn_shared("a", "--inner-steps", "10", "--min-peers", "2", checkpoint=False)
    return first, spawn_shared("b", "--inner-steps", "10", "--min-peers", "2", peer=first, checkpoint=False)


def test_status_api_reports_the_run(pair: tuple[NodeProcess, NodeProcess]) -> None:
    first, second = pair
    round_ = 1
    first.wait_for_round(round_ + 1)
    second.wait_for_round(round_ + 1)
    status = second.status()
    for key in ("run_id", "peer_id", "maddrs", "outer_step", "inner_step", "loss", "eval_loss", "peers",
                "group_size", "bytes_sent", "bytes_received", "model_digest"):
        assert key in status, key
    assert status["run_id"] == "itest" and status["peers"] == 2 and status["group_size"] == 2
    assert status["bytes_sent"] > 0 and status["bytes_received"] > 0
    # The wire (measured from the libp2p daemon's TCP counters) carries the payload and more.
    assert status["wire_bytes_sent"] > status["bytes_sent"] > 0, status
    assert status["wire_bytes_received"] > status["bytes_received"] > 0, status
    history = second.get("/api/history")["rounds"]
    assert all(r["wire_sent"] > 0 and r["wire_received"] > 0 for r in history), history
    assert second.address and status["peer_id"] in second.address
    assert status["outer_step"] >= round_ + 1


def test_late_joiner_reaches_the_same_digest(spawn: NodeFactory, pair: tuple[NodeProcess, NodeProcess]) -> None:
    first, second = pair
    second.wait_for_round(2)
    late = spawn("late", "--inner-steps", "10", peer=second, checkpoint=False)
    joined = late.wait_joined()
    assert joined >= 2, "the late joiner should have downloaded the swarm's round, not started at 0"
    late.wait_until(lambda: len(late.rounds) >= 2, 120, "two rounds")
    # normally joined + 1 and + 2. A joiner that caught the swarm mid-step re-syncs once first, and
    # under load a round of three may split (seen once in CI: the joiner and one node averaged, its
    # server alone); the φ of all three must then agree again from the next round on
    nodes, first_round = [first, second, late], min(late.rounds)
    digests = [{n.name: n.wait_for_round(r).digest for n in nodes} for r in range(first_round, first_round + 2)]
    while not all(len(set(d.values())) == 1 for d in digests[-2:]):
        assert len(digests) < 5, f"φ differs across nodes in rounds {first_round}–{first_round + len(digests) - 1}: " \
                                 f"{digests}\n{log_tails(nodes)}"
        digests.append({n.name: n.wait_for_round(first_round + len(digests)).digest for n in nodes})
