"""What the dashboard says a node sent, against what left its island's wire (veth counters).

Two nodes in two islands joined by a 100 Mbit/s tbf link; each island holds one node, so the
island's eth0 tx counter is exactly that node's wire traffic (IP/TCP headers, noise/yamux framing,
ACKs, DHT and matchmaking included). Counting starts before the nodes start, because the dashboard's
`bytes_sent` counts from the node's start too (the state a joiner downloads at start-up is in it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.nodes import FAST, NodeProcess
from tests.network.islands import Island, Islands
from tests.network.test_islands import need_netns

RATE_MBIT = 100.0
ROUNDS = 4
TOLERANCE = 0.10

_STATUS = ("import sys, urllib.request; "
           "print(urllib.request.urlopen(sys.argv[1] + '/api/status', timeout=10).read().decode())")


@dataclass
class IslandNode(NodeProcess):
    """A `diloco-node join` process inside an island; its status server is on the island's loopback."""

    island: Island | None = None

    def start(self) -> IslandNode:
        assert self.island is not None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = self.island.run([sys.executable, "-m", "diloco_node", "join", *self.args],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                       cwd=self.workdir)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        return self

    def status(self) -> dict[str, Any]:
        assert self.island is not None and self.status_url
        return json.loads(self.island.check_output([sys.executable, "-c", _STATUS, self.status_url]))


def node_options(island: Island) -> list[str]:
    options = list(FAST)
    options[options.index("--listen") + 1] = f"/ip4/{island.address}/tcp/0"
    return [*options, "--run-id", "wire-bytes", "--min-peers", "2", "--inner-steps", "5", "--checkpoint-dir", "",
            "--max-outer-steps", "0", "--compression", "none"]


@dataclass(frozen=True)
class Tally:
    dashboard: int  # bytes_sent on /api/status
    wire: int  # the island's eth0 tx bytes over the same time

    @property
    def ratio(self) -> float:
        return self.dashboard / self.wire


@pytest.fixture(scope="module")
def tallies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tally]:
    """Run two nodes for ROUNDS rounds; per node, dashboard bytes_sent vs its island's wire bytes."""
    need_netns()
    workdir = tmp_path_factory.mktemp("wire")
    with Islands(count=2, rate_mbit=RATE_MBIT) as islands:
        island_a, island_b = islands
        wire_before = {island.namespace: island.tx_bytes() for island in islands}
        a = IslandNode("a", node_options(island_a), workdir, island=island_a).start()
        b = IslandNode("b", [*node_options(island_b), "--peer", a.wait_for_address()], workdir,
                       island=island_b).start()
        nodes = [(a, island_a), (b, island_b)]
        first = max(node.wait_joined() for node, _ in nodes)
        for node, _ in nodes:
            node.wait_for_round(first + ROUNDS, timeout=90)
        result = {}
        for node, island in nodes:
            dashboard = node.status()["bytes_sent"]
            result[node.name] = Tally(dashboard, island.tx_bytes() - wire_before[island.namespace])
        print(describe(result))
        return result  # leaving the with-block kills both nodes and deletes the islands


def describe(tallies: dict[str, Tally]) -> str:
    return ", ".join(f"{name}: dashboard={t.dashboard} wire={t.wire} ratio={t.ratio:.3f}"
                     for name, t in tallies.items())


def test_dashboard_never_claims_more_than_the_wire_carried(tallies: dict[str, Tally]) -> None:
    for tally in tallies.values():
        assert tally.dashboard > 1_000_000, describe(tallies)  # ≥ ROUNDS fp32 payloads of the tiny model
        assert tally.ratio <= 1.0 + 0.02, describe(tallies)


@pytest.mark.xfail(strict=True, reason=(
    "bytes_sent counts payload and state bytes only; hivemind's matchmaking/DHT control traffic adds "
    "~0.3-0.45 MB per node per round at --matchmaking-time 2 (≈150 KB/s while matchmaking), so the "
    "dashboard shows ~0.70-0.87 of the wire (measured on the tiny model, --compression none, H=5)"))
def test_dashboard_bytes_agree_with_the_wire_within_10_percent(tallies: dict[str, Tally]) -> None:
    for tally in tallies.values():
        assert abs(tally.ratio - 1.0) <= TOLERANCE, describe(tallies)
