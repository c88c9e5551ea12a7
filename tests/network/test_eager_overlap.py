"""Eager updates on a slow link: the node trains round t+1 while round t's exchange is in flight.

Two islands joined by a 5 Mbit/s tbf link; the fp32 pseudo-gradient of the tiny model (~1.8 MB)
takes about 3 s to cross it, longer than a round's inner phase here. The test polls one node's
/api/status: `exchanging_round` names the exchange in flight and `inner_step` counts training
steps. Under eager, inner steps must advance while an exchange is in flight (under blocking they
cannot: the node waits for it), every round's exchange must reach the peer, and both nodes learn.
"""

from __future__ import annotations

import time
from typing import Any

from harness.islands import IslandNode, Islands, node_options
from tests.network.test_islands import need_netns

RATE_MBIT = 5.0
ROUNDS = 3


def test_eager_keeps_training_while_the_exchange_is_in_flight(tmp_path) -> None:  # type: ignore[no-untyped-def]
    need_netns()
    with Islands(count=2, rate_mbit=RATE_MBIT) as islands:
        a_island, b_island = islands
        extra = ["--sync", "eager", "--inner-steps", "20", "--compression", "none"]
        a = IslandNode("a", [*node_options(a_island, "eager-overlap"), *extra], tmp_path, island=a_island).start()
        b = IslandNode("b", [*node_options(b_island, "eager-overlap"), *extra, "--peer", a.wait_for_address()],
                       tmp_path, island=b_island).start()
        first = max(node.wait_joined() for node in (a, b))
        samples: list[dict[str, Any]] = []
        deadline = time.monotonic() + 150
        while first + ROUNDS not in a.rounds:
            assert time.monotonic() < deadline, f"no round {first + ROUNDS} in time:\n{a.log_text()[-3000:]}"
            status = a.status()
            samples.append({"inner_step": status["inner_step"], "exchanging": status.get("exchanging_round")})
            time.sleep(0.2)  # each poll starts a process in the namespace: leave the cores to training
        b.wait_for_round(first + ROUNDS, timeout=60)

    trained_during = {later["exchanging"] for earlier, later in zip(samples, samples[1:], strict=False)
                      if later["exchanging"] is not None and later["exchanging"] == earlier["exchanging"]
                      and later["inner_step"] > earlier["inner_step"]}
    assert trained_during, f"inner steps never advanced while an exchange was in flight: {samples}"
    for node in (a, b):
        rounds = [node.rounds[r] for r in range(first + 2, first + ROUNDS + 1)]
        # From the second round on, each applied exchange is the previous round's, with the peer in it.
        assert all(r.group_size == 2 for r in rounds), node.log_text()[-3000:]
        assert rounds[-1].eval_loss < node.rounds[first + 1].eval_loss, node.log_text()[-3000:]
