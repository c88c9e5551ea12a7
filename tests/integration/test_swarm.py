"""Real nodes through the real CLI on loopback: agreement, late joining, crashes, resume, shutdown."""

from __future__ import annotations

import signal
import time

import pytest

from diloco_node.commands.launch import NodeProcess
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

def log_tails(nodes: list[NodeProcess], lines: int = 20) -> str:
    """Each node's last log lines: what a failure shows (CI's excerpt cuts the middle of longer text)."""
    return "\n".join(f"--- {node.name}:\n" + "\n".join(node.log_text().splitlines()[-lines:]) for node in nodes)


def assert_same_digests(nodes: list[NodeProcess], rounds: range) -> None:
    for round_ in rounds:
        digests = {node.name: node.wait_for_round(round_).digest for node in nodes}
        assert len(set(digests.values())) == 1, f"round {round_}: φ differs across nodes: {digests}\n{log_tails(nodes)}"


def test_three_nodes_agree_every_round_and_learn(spawn: NodeFactory) -> None:
    # centered-clip: the most involved aggregator must still give every node the same bits
    options = ("--inner-steps", "10", "--max-outer-steps", "4", "--min-peers", "3", "--aggregator", "centered-clip")
    first = spawn("a", *options)
    nodes = [first, *(spawn(name, *options, peer=first) for name in ("b", "c"))]
    assert_same_digests(nodes, range(1, 5))
    for node in nodes:
        assert node.joined_round == 0
        # a fresh run: every node builds φ0 from the seed, so nobody downloads the first node's copy
        assert "synced state" not in node.log_text(), node.log_text()[-3000:]
    for node in nodes[1:]:
        assert "the run's state is the one we hold" in node.log_text(), node.log_text()[-3000:]
        assert [node.rounds[r].group_size for r in range(1, 5)] == [3] * 4
        losses = [node.joined_eval_loss] + [node.rounds[r].eval_loss for r in range(1, 5)]
        assert losses[-1] < losses[0] - 0.5, f"{node.name}: eval loss did not fall: {losses}"
        assert node.wait_exit() == 0


def test_resume_continues_at_the_saved_round(spawn: NodeFactory) -> None:
    first = spawn("solo", "--inner-steps", "10", "--max-outer-steps", "3", run_id="resume")
    saved = first.wait_for_round(3)
    assert first.wait_exit() == 0
    again = spawn("solo", "--inner-steps", "10", "--max-outer-steps", "5", run_id="resume")
    again.wait_for_round(5)
    assert again.joined_round == 3 and min(again.rounds) == 4
    assert "resumed round=3" in again.log_text()
    assert again.joined_eval_loss == pytest.approx(saved.eval_loss, abs=1e-4)


def test_a_node_that_leaves_is_not_waited_for(spawn: NodeFactory) -> None:
    # With a round timeout far beyond the test's patience, the survivor can only go on if the
    # leaver's presence record is withdrawn when it exits.
    options = ("--inner-steps", "10", "--round-timeout", "900", "--min-peers", "2")
    first = spawn("a", *options, checkpoint=False)
    leaver = spawn("b", *options, peer=first, checkpoint=False)
    leaver.wait_for_round(1)
    leaver.signal(signal.SIGTERM)
    assert leaver.wait_exit() == 0
    last = max(leaver.rounds)
    assert first.wait_for_round(last + 2, timeout=90).group_size == 1


# Three runs at a time, each a pair that only ever meets its own run: every codec in a third of the time.
CODEC_BATCHES = [("none", "fp16", "bf16"), ("int8", "int4", "topk"), ("topk-2bit", "topk-1bit", "sign")]
CODEC_FLAGS = {"topk-2bit": ("--compression", "topk", "--topk-bits", "2", "--topk-k", "24"),
               "topk-1bit": ("--compression", "topk", "--topk-bits", "1", "--topk-chunk", "300", "--topk-k", "20")}


@pytest.mark.parametrize("codecs", CODEC_BATCHES, ids="-".join)
def test_two_nodes_complete_rounds_with_every_codec(spawn: NodeFactory, codecs: tuple[str, ...]) -> None:
    def options(codec: str) -> tuple[str, ...]:
        return ("--inner-steps", "5", "--max-outer-steps", "2", "--min-peers", "2",
                *CODEC_FLAGS.get(codec, ("--compression", codec)))

    firsts = {codec: spawn(f"{codec}-a", *options(codec), run_id=f"codec-{codec}", checkpoint=False)
              for codec in codecs}
    pairs = {codec: [first, spawn(f"{codec}-b", *options(codec), run_id=f"codec-{codec}", peer=first,
                                  checkpoint=False)] for codec, first in firsts.items()}
    for codec, pair in pairs.items():
        assert_same_digests(pair, range(1, 3))
        assert pair[0].rounds[2].group_size == 2, codec
        for node in pair:
            assert node.wait_exit() == 0, node.log_text()


@pytest.mark.parametrize("sync", ["delayed", "eager"])
def test_overlapped_sync_modes_train_and_exchange(spawn: NodeFactory, sync: str) -> None:
    options = ("--inner-steps", "10", "--max-outer-steps", "3", "--min-peers", "2", "--sync", sync)
    first = spawn("a", *options, run_id=f"sync-{sync}", checkpoint=False)
    second = spawn("b", *options, run_id=f"sync-{sync}", peer=first, checkpoint=False)
    for node in (first, second):
        node.wait_for_round(3)
        # from round 2 on, each outer step used the previous round's exchange with the peer
        assert [node.rounds[r].group_size for r in (2, 3)] == [2, 2], node.log_text()
        assert node.rounds[3].eval_loss < (node.joined_eval_loss or 0) - 0.5, node.log_text()
        assert node.wait_exit() == 0
        # at the planned end, the last round's exchange is applied too, not dropped
        assert "settled round=3 " in node.log_text(), node.log_text()


def test_a_joiner_completes_a_round_its_server_averaged_alone_at_once(spawn: NodeFactory) -> None:
    """A node training alone serves a state whose last round it averaged by itself, still in flight
    under eager: the joiner completes that round from the server's own payload, at once. It waited
    a whole round timeout for a group that never formed, then lost the round and re-synced."""
    options = ("--inner-steps", "10", "--sync", "eager", "--round-timeout", "60")
    first = spawn("a", *options, checkpoint=False)
    first.wait_for_round(2)
    joiner = spawn("b", *options, peer=first, checkpoint=False)
    joiner.wait_joined()
    joined = time.monotonic()
    joiner.wait_until(lambda: len(joiner.rounds) >= 1, 120, "a first round")
    assert time.monotonic() - joined < 30, joiner.log_text()[-3000:]
    assert "could not fetch the mean" not in joiner.log_text(), joiner.log_text()[-3000:]
    # and its own first round counts: that exchange, landing a round late, was with the server. The
    # first round's line names the server's round in flight it completed (group_round), if any
    first_round = min(joiner.rounds)
    assert joiner.rounds[first_round].group_round in (first_round - 1, None), joiner.log_text()[-3000:]
    joiner.wait_until(lambda: len(joiner.rounds) >= 2, 120, "a second round")
    own_first = joiner.rounds.get(first_round + 1)  # missing: the joiner re-synced after its first round
    assert own_first is not None and (own_first.group_round, own_first.group_size) == (first_round, 2), \
        log_tails([first, joiner], 30)
