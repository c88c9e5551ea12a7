"""A node's start-up asks for the run's state again while a fresh node would only fall behind
(daemon/node.py `Node.take_run_state`); the download and the swarm are stand-ins for their seams."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from diloco_node.daemon.node import Node


class Starting:
    """What take_run_state reads of a node: its downloads' outcomes in turn, and the run's records."""

    def __init__(self, outcomes: list[bool], ahead: bool) -> None:
        self.outcomes, self.asked = outcomes, 0
        self.swarm = SimpleNamespace(ahead_of=lambda round_: ahead)
        self.state = SimpleNamespace(round=0)
        self.stop_requested = threading.Event()

    def sync_from_peers(self, fresh: bool = False) -> bool:
        self.asked += 1
        return self.outcomes.pop(0)


def test_a_fresh_node_of_a_run_past_its_round_asks_again_until_the_state_arrives(
        caplog: pytest.LogCaptureFixture) -> None:
    node = Starting([False, False, True], ahead=True)
    with caplog.at_level(logging.WARNING):
        Node.take_run_state(node, fresh=True)  # type: ignore[arg-type]
    assert node.asked == 3
    assert [r.getMessage().split(":")[0] for r in caplog.records] == \
        ["the run is past round 0 and no peer shared its state in time"] * 2


@pytest.mark.parametrize("fresh, ahead", [(False, True), (True, False)])
def test_a_resumed_node_or_a_run_at_our_round_asks_once(fresh: bool, ahead: bool) -> None:
    node = Starting([False], ahead=ahead)  # a resumed node goes on from its own φ; a new run needs none
    Node.take_run_state(node, fresh=fresh)  # type: ignore[arg-type]
    assert node.asked == 1


def test_a_stop_ends_the_asking() -> None:
    node = Starting([False], ahead=True)
    node.stop_requested.set()
    Node.take_run_state(node, fresh=True)  # type: ignore[arg-type]
    assert node.asked == 1
