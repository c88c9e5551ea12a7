"""Many real nodes in one run, exchanging by butterfly (swarm/butterfly.py): the same φ on all of
them, and per-node traffic that does not grow with the group (docs/architecture.md §2, #16)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import NodeFactory
from tests.integration.test_swarm import assert_same_digests

pytestmark = pytest.mark.integration

NODES = 8  # what CI holds on two cores; benchmarks/scale.py goes to 16
ROUNDS = 3
# Each node pushes (M−1)/M of its payload and sends back its averaged part M−1 times: 2·(M−1)/M,
# plus headers, requests and the groups' peer ids in the answers' reports.
BYTES_BOUND = 2.2


def test_eight_nodes_agree_bit_for_bit_and_each_sends_about_two_payloads(spawn: NodeFactory) -> None:
    options = ("--exchange", "butterfly", "--inner-steps", "3", "--max-outer-steps", str(ROUNDS),
               "--min-peers", str(NODES), "--round-timeout", "120", "--batch-size", "4", "--eval-batches", "1")
    first = spawn("n0", *options)
    nodes = [first, *(spawn(f"n{index}", *options, peer=first) for index in range(1, NODES))]
    assert_same_digests(nodes, range(1, ROUNDS + 1))
    for node in nodes:
        for round_ in range(1, ROUNDS + 1):
            log = node.rounds[round_]
            assert log.group_size == NODES, f"{node.name} round {round_}: group of {log.group_size}"
            payload = log.payload_bytes
            # round 1 may carry a state download; later rounds move payloads only
            if round_ > 1:
                for direction in ("bytes_sent", "bytes_received"):
                    ratio = getattr(log, direction) / payload
                    assert ratio <= BYTES_BOUND, f"{node.name} round {round_}: {direction} {ratio:.2f}× the payload"
                    assert ratio >= 2 * (NODES - 1) / NODES * 0.95, f"{node.name}: {direction} {ratio:.2f}× is too few"
        assert node.wait_exit() == 0
