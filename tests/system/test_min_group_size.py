"""--min-group-size (docs/architecture.md §9): with a minimum of 3 a pair of real nodes never
averages (each round is held: no payload fetched, φ unchanged and the same on both), while three
nodes average together as usual."""

from __future__ import annotations

import pytest

from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

ROUNDS = 3
OPTIONS = ("--min-group-size", "3", "--inner-steps", "5", "--max-outer-steps", str(ROUNDS))


def test_a_pair_holds_every_round_with_a_minimum_of_three(spawn: NodeFactory) -> None:
    first = spawn("a", *OPTIONS, "--min-peers", "2", run_id="pair")
    second = spawn("b", *OPTIONS, "--min-peers", "2", run_id="pair", peer=first)
    nodes = (first, second)
    for node in nodes:
        node.wait_joined()
    digests = {str(node.events_of("joined")[0]["digest"]) for node in nodes}
    assert len(digests) == 1  # both built φ0 from the seed
    for node in nodes:
        for round_ in range(1, ROUNDS + 1):
            record = node.wait_for_round(round_)
            logs = node.log_text()[-3000:]
            assert record.outcome == "held", logs
            assert record.group == () and not record.transfer_bytes, logs  # nothing taken from the other
            assert record.digest in digests, logs  # φ took no step
        assert "below --min-group-size 3, so no outer step" in node.log_text()
        assert node.wait_exit() == 0


def test_three_nodes_average_together_with_a_minimum_of_three(spawn: NodeFactory) -> None:
    first = spawn("a", *OPTIONS, "--min-peers", "3", run_id="trio")
    nodes = [first, *(spawn(name, *OPTIONS, "--min-peers", "3", run_id="trio", peer=first) for name in "bc")]
    first.wait_joined()
    joined = {str(first.events_of("joined")[0]["digest"])}
    for round_ in range(1, ROUNDS + 1):
        records = {node.name: node.wait_for_round(round_) for node in nodes}
        logs = "\n".join(f"--- {node.name}:\n{node.log_text()[-2000:]}" for node in nodes)
        assert {r.outcome for r in records.values()} == {"together"}, logs
        assert {r.group_size for r in records.values()} == {3}, logs
        assert len({r.digest for r in records.values()}) == 1, logs  # the same φ everywhere
        assert not {r.digest for r in records.values()} & joined, logs  # and it stepped
    for node in nodes:
        assert node.wait_exit() == 0
