"""A volunteer's node starts every time and stops when asked, many times in a row.

Start-up once froze now and then (a subprocess spawned while hivemind forked); a race like that
shows only over many starts, so this starts and stops a node 20 times, alternating Ctrl-C and
SIGTERM, each start resuming the last stop's checkpoint. The 20 starts run as two chains of 10
side by side (two nodes, each its own run): the same number of starts in about half the time, and
each start races the other chain's start-up and stop for the CPU, as nodes sharing a machine do.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

CHAINS = 2
STARTS = 10  # per chain
START_BOUND = 90.0  # from the process starting to its first trained round
STOP_BOUND = 30.0


def starts_and_stops(spawn: NodeFactory, name: str) -> None:
    expected_round = 0
    for attempt in range(STARTS):
        started = time.monotonic()
        node = spawn(name, "--inner-steps", "3", run_id=f"restarts-{name}")
        assert node.wait_joined(timeout=START_BOUND) == expected_round, f"{name}: start {attempt}"
        node.wait_for_round(expected_round + 1, timeout=START_BOUND - (time.monotonic() - started))
        node.stop("ctrl-c" if attempt % 2 == 0 else "sigterm", within=STOP_BOUND)
        expected_round = int(node.log_text().split("left the swarm at round=")[1].split()[0])
        assert expected_round > 0


@pytest.mark.timeout(STARTS * (START_BOUND + STOP_BOUND))
def test_twenty_starts_and_stops_in_a_row(spawn: NodeFactory) -> None:
    with ThreadPoolExecutor(CHAINS) as pool:
        chains = [pool.submit(starts_and_stops, spawn, name) for name in "ab"[:CHAINS]]
        for chain in chains:
            chain.result()  # a chain's failure is raised here, with its assertion's message
