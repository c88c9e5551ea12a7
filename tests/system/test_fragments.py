"""--fragments (docs/architecture.md §15) through two real nodes under blocking sync: each round
exchanges one fragment in turn (a payload of that fragment only), steps it, and both nodes hold the
same φ after every round."""

from __future__ import annotations

import pytest

from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

ROUNDS = 3
# int8: about one byte a parameter whatever the values (no zstd), so payload sizes follow the fragments'
OPTIONS = ("--fragments", "2", "--inner-steps", "2", "--eval-batches", "1", "--compression", "int8",
           "--max-outer-steps", str(ROUNDS), "--min-peers", "2")


def test_two_nodes_exchange_one_fragment_a_round_and_hold_the_same_phi_after_each(spawn: NodeFactory) -> None:
    first = spawn("a", *OPTIONS, run_id="fragments")
    second = spawn("b", *OPTIONS, run_id="fragments", peer=first)
    nodes = (first, second)
    for node in nodes:
        node.wait_joined()
    previous = {str(first.events_of("joined")[0]["digest"])}
    payloads = []
    for round_ in range(1, ROUNDS + 1):
        records = [node.wait_for_round(round_) for node in nodes]
        logs = "\n".join(f"--- {node.name}:\n{node.log_text()[-2500:]}" for node in nodes)
        assert {r.outcome for r in records} == {"together"}, logs
        assert len({r.digest for r in records}) == 1, logs  # the same φ on both after the fragment's step
        assert not {r.digest for r in records} & previous, logs  # and it stepped
        previous = {records[0].digest}
        payloads.append(records[0].payload_bytes)
    # rounds alternate between the two fragments: neither round carries the whole model, and the
    # same fragment comes back with a payload of the same length (int8: its length fixes the bytes)
    assert payloads[0] == payloads[2] != payloads[1], payloads
    assert max(payloads[0], payloads[1]) <= 0.65 * (payloads[0] + payloads[1]), payloads
    for node in nodes:
        assert node.wait_exit() == 0
