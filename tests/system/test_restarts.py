"""A volunteer's node starts every time and stops when asked, many times in a row.

Start-up once froze now and then (a subprocess spawned while hivemind forked); a race like that
shows only over many starts, so this starts and stops one node 20 times, alternating Ctrl-C and
SIGTERM, each start resuming the last stop's checkpoint.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

STARTS = 20
START_BOUND = 90.0  # from the process starting to its first trained round
STOP_BOUND = 30.0


@pytest.mark.timeout(STARTS * (START_BOUND + STOP_BOUND))
def test_twenty_starts_and_stops_in_a_row(spawn: NodeFactory) -> None:
    expected_round = 0
    for attempt in range(STARTS):
        started = time.monotonic()
        node = spawn("a", "--inner-steps", "3")
        assert node.wait_joined(timeout=START_BOUND) == expected_round, f"start {attempt}"
        node.wait_for_round(expected_round + 1, timeout=START_BOUND - (time.monotonic() - started))
        node.stop("ctrl-c" if attempt % 2 == 0 else "sigterm", within=STOP_BOUND)
        expected_round = int(node.log_text().split("left the swarm at round=")[1].split()[0])
        assert expected_round > 0
