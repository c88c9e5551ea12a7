"""What the dashboard says a node sent and received, against its island's wire (veth counters).

Two nodes in two islands joined by a 100 Mbit/s tbf link; each island holds one node, so the
island's eth0 counters are exactly that node's wire traffic (IP/TCP headers, noise/yamux framing,
ACKs, DHT and matchmaking included). Counting starts before the nodes start, because the dashboard
counts from the node's start too (the state a joiner downloads at start-up is in it).

The dashboard shows two figures: payload bytes (`bytes_sent`, what the codecs are judged by) and
wire bytes (`wire_bytes_sent`, measured from the kernel's TCP counters of the node's libp2p daemon,
see telemetry/wire.py). Payload can never exceed the wire; the wire figure must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from harness.islands import Island, IslandNode, Islands
from harness.islands import node_options as island_node_options
from tests.network.test_islands import need_netns

RATE_MBIT = 100.0
ROUNDS = 4
TOLERANCE = 0.10


def node_options(island: Island) -> list[str]:
    return [*island_node_options(island, "wire-bytes"), "--inner-steps", "5", "--compression", "none"]


@dataclass(frozen=True)
class Tally:
    """One node's /api/status read between two reads of its island's counters (bytes since start)."""

    payload_sent: int  # bytes_sent on /api/status
    dashboard: tuple[int, int]  # wire_bytes_sent, wire_bytes_received on /api/status
    veth_before: tuple[int, int]  # the island's eth0 tx, rx bytes just before the status read
    veth_after: tuple[int, int]  # ... and just after it

    def agrees(self, tolerance: float) -> bool:
        """Within `tolerance` of the wire at some moment of the read (traffic goes on while we read)."""
        return all((1 - tolerance) * before <= shown <= (1 + tolerance) * after
                   for shown, before, after in zip(self.dashboard, self.veth_before, self.veth_after, strict=True))


@pytest.fixture(scope="module")
def tallies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tally]:
    """Run two nodes for ROUNDS rounds; per node, what the dashboard reports against its island's wire."""
    need_netns()
    workdir = tmp_path_factory.mktemp("wire")
    with Islands(count=2, rate_mbit=RATE_MBIT) as islands:
        island_a, island_b = islands
        start = {island.namespace: (island.tx_bytes(), island.rx_bytes()) for island in islands}

        def veth(island: Island) -> tuple[int, int]:
            tx, rx = start[island.namespace]
            return island.tx_bytes() - tx, island.rx_bytes() - rx

        a = IslandNode("a", node_options(island_a), workdir, island=island_a).start()
        b = IslandNode("b", [*node_options(island_b), "--peer", a.wait_for_address()], workdir,
                       island=island_b).start()
        nodes = [(a, island_a), (b, island_b)]
        first = max(node.wait_joined() for node, _ in nodes)
        for node, _ in nodes:
            node.wait_for_round(first + ROUNDS, timeout=90)
        result = {}
        for node, island in nodes:
            before = veth(island)
            status = node.status()
            result[node.name] = Tally(status["bytes_sent"], (status["wire_bytes_sent"], status["wire_bytes_received"]),
                                      before, veth(island))
        print(describe(result))
        return result  # leaving the with-block kills both nodes and deletes the islands


def describe(tallies: dict[str, Tally]) -> str:
    return "; ".join(f"{name}: payload sent={t.payload_sent}, dashboard wire sent/received={t.dashboard}, "
                     f"veth tx/rx before={t.veth_before} after={t.veth_after}" for name, t in tallies.items())


def test_payload_bytes_never_exceed_what_the_wire_carried(tallies: dict[str, Tally]) -> None:
    for tally in tallies.values():
        assert tally.payload_sent > 1_000_000, describe(tallies)  # ≥ ROUNDS fp32 payloads of the tiny model
        assert tally.payload_sent <= tally.veth_after[0], describe(tallies)


def test_dashboard_wire_bytes_agree_with_the_veth_counters_within_10_percent(tallies: dict[str, Tally]) -> None:
    for tally in tallies.values():
        assert tally.agrees(TOLERANCE), describe(tallies)
