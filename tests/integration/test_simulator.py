"""The learning simulator (harness/simulator.py) runs the node's own learning path: for the same
config, seeds and peer ids, its φ after each round is bit for bit the φ of two real nodes over
loopback (blocking fp32 and int4, and eager: its exchange lands a round late on both, the same way,
as long as every exchange holds both nodes, which two nodes waiting for each other do).
benchmarks/learning.py's searches rest on this."""

from __future__ import annotations

import pytest

from diloco_node.config import NodeConfig
from harness.simulator import simulate
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

H, ROUNDS = 5, 3


@pytest.mark.parametrize(("sync", "compression"), [("blocking", "none"), ("blocking", "int4"), ("eager", "none")])
def test_simulator_digests_equal_real_nodes(spawn: NodeFactory, sync: str, compression: str) -> None:
    flags = ["--inner-steps", str(H), "--max-outer-steps", str(ROUNDS), "--min-peers", "2",
             "--compression", compression, "--sync", sync]
    first = spawn("a", *flags, checkpoint=False)
    second = spawn("b", *flags, peer=first, checkpoint=False)
    for node in (first, second):
        assert node.wait_exit(180) == 0, node.tail()
    peers = [node.address.rsplit("/p2p/", 1)[1] for node in (first, second) if node.address]
    assert len(peers) == 2
    # harness.nodes.FAST, the flags every integration node runs with, and the ones above
    cfg = NodeConfig.model_validate({
        "run_id": "itest", "sync": sync, "seq_len": 64, "batch_size": 8, "eval_batches": 2,
        "warmup_steps": 5, "threads": 1, "inner_steps": H, "max_outer_steps": ROUNDS, "compression": compression})
    curve = simulate(cfg, peers, ROUNDS, evaluate=False)
    # a round's record names the round φ reached: 1 after the first
    real = [[node.rounds[round_].digest for node in (first, second)] for round_ in range(1, ROUNDS + 1)]
    assert curve.digests == real


def test_inner_state_reset_starts_each_round_with_fresh_moments() -> None:
    """`inner_state=reset` (benchmarks/learning.py's measurement of the alternative): the first round
    is a node's (no moments yet either way); from the second the moments start afresh, so φ differs."""
    cfg = NodeConfig.model_validate({
        "run_id": "itest", "sync": "blocking", "seq_len": 64, "batch_size": 8, "eval_batches": 2,
        "warmup_steps": 5, "threads": 1, "inner_steps": H, "max_outer_steps": ROUNDS, "compression": "none"})
    peers = ["12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44]
    kept = simulate(cfg, peers, 2, evaluate=False)
    reset = simulate(cfg, peers, 2, evaluate=False, inner_state="reset")
    assert kept.digests[0] == reset.digests[0]
    assert kept.digests[1] != reset.digests[1]
    with pytest.raises(ValueError, match="kept or reset"):
        simulate(cfg, peers, 1, inner_state="forget")
