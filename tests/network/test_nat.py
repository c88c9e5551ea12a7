"""A volunteer behind a NAT trains with two public nodes (#16, reachability.py, butterfly.py).

Islands a and b are public (100 Mbit/s links); c sits on a LAN behind b's namespace, which
masquerades it as a home router does: c reaches everyone, nobody can open a connection to c. In an
open run that asks for the butterfly (an open run's `auto` never uses it: a client flag is
self-declared, docs/architecture.md §9) c finds at start-up that no peer can dial it, joins as a
client, and the group exchanges by butterfly with c owning no part. Under blocking all three hold the same
φ round after round; c's status says it is a client, and a's and b's that they are public.
"""

from __future__ import annotations

import pytest

from harness.islands import IslandNode, Islands, node_options
from tests.integration.test_swarm import assert_same_digests
from tests.network.test_islands import need_netns

RATE_MBIT = 100.0
ROUNDS = 4
OPTIONS = ["--sync", "blocking", "--inner-steps", "5", "--min-peers", "3", "--max-outer-steps", str(ROUNDS),
           "--exchange", "butterfly"]


@pytest.mark.timeout(600)
def test_a_node_behind_a_nat_joins_as_a_client_and_agrees(tmp_path) -> None:  # type: ignore[no-untyped-def]
    need_netns()
    with Islands(count=2, rate_mbit=RATE_MBIT) as islands:
        public_a, public_b = islands[0], islands[1]
        home = islands.behind_nat(public_b)
        nodes: list[IslandNode] = []
        for name, island in (("a", public_a), ("b", public_b), ("c", home)):
            peer = ["--peer", nodes[0].wait_for_address()] if nodes else []
            options = [*node_options(island, "nat"), *OPTIONS, *peer]  # the later flags win
            nodes.append(IslandNode(name, options, tmp_path, island=island).start())
        a, b, c = nodes
        for node in nodes:
            node.wait_joined()
        assert [node.status()["reachability"] for node in nodes] == ["public", "public", "client"]
        assert "joining as a client" in c.log_text()
        assert_same_digests(nodes, range(1, ROUNDS + 1))
        for node in nodes:
            assert [node.rounds[r].group_size for r in range(1, ROUNDS + 1)] == [3] * ROUNDS, node.log_text()[-3000:]
            assert node.wait_exit() == 0
