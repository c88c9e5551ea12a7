"""Partitions heal: a node cut off from the swarm pauses, finds the swarm again and agrees with it.

Three nodes in three islands (100 Mbit/s links, blocking, H = 20, --round-timeout 20). Island c's
link is cut (the hub stops bridging it: packets vanish, as when an uplink fails upstream) for
10 s, 60 s and 150 s in turn. Each time:
- during the cut, a and b go on as a pair; c reports itself isolated (status API) and does not
  race through solo rounds;
- within 4 of a's rounds after the link is back, all three hold the same model_digest;
- no node crashes;
- c runs under `--upload-limit` (docs/architecture.md §14): its link's egress (the veth's tx counter:
  DHT, records, retransmissions and headers included) stays within 1.1 × the cap in every 1-second
  window from each cut to the agreement after its heal, when its connections come back at once.
The rounds and seconds to agree again are printed (docs/scale-and-networks.md quotes them).
"""

from __future__ import annotations

import sys
import time

import pytest

from harness.islands import IslandNode, Islands, node_options
from harness.nodes import agreed_round
from harness.wire import WireSampler, windows
from tests.network.test_islands import need_netns

RATE_MBIT = 100.0
# 10 s: shorter than a record's life (records.RECORD_TTL, 25 s), so c never looks isolated; 60 s and
# 150 s: isolated. 150 s is the long cut: the old TCP connection's retransmissions are then about
# 100 s apart (doubling from 0.2 s), far beyond the 4 rounds to agree, as is a daemon's backoff
# after failed dials (what a long cut once broke, docs/scale-and-networks.md "Partitions"); the 5-minute cut this had
# proved nothing more and cost 2.5 more minutes
CUTS = (10.0, 60.0, 150.0)
AGREE_WITHIN_ROUNDS = 4
OPTIONS = ["--sync", "blocking", "--compression", "none", "--inner-steps", "20", "--round-timeout", "20",
           "--min-peers", "3"]
# c's upload cap: its payloads (tiny, uncompressed: 2 × 1.8 MB a round) take it ~4 s a round at it,
# so its link runs at the cap whenever it exchanges (at the default int4, 8× smaller, it would not)
CAP = "8mbit"
CAP_BYTES = 1_000_000  # bytes/s
SAMPLE_SECONDS = 0.25


@pytest.mark.timeout(sum(CUTS) + 600)
def test_a_cut_off_node_pauses_rejoins_and_agrees(tmp_path) -> None:  # type: ignore[no-untyped-def]
    need_netns()
    with Islands(count=3, rate_mbit=RATE_MBIT) as islands:
        nodes: list[IslandNode] = []
        for name, island in zip("abc", islands, strict=True):
            peer = ["--peer", nodes[0].wait_for_address()] if nodes else []
            capped = ["--upload-limit", CAP] if name == "c" else []
            nodes.append(IslandNode(name, [*node_options(island, "partition"), *OPTIONS, *capped, *peer], tmp_path,
                                    island=island).start())
        a, b, c = nodes
        with WireSampler(islands[2].tx_bytes, SAMPLE_SECONDS) as c_egress:  # c's link, sent
            start = max(node.wait_joined() for node in nodes)
            a.wait_until(lambda: agreed_round(nodes, start) is not None, 120, "three nodes agreeing")
            figures = []
            for cut in CUTS:
                c_rounds_before = len(c.rounds)
                cut_at = c_egress.sample()[0]
                islands[2].cut()
                deadline = time.monotonic() + cut
                isolated_seen = False
                while time.monotonic() < deadline:
                    if not isolated_seen and time.monotonic() > deadline - cut + 25:
                        status = c.status()  # from c's own island: its status server is local to it
                        isolated_seen = status["isolated"] is True and status["isolated_since"] is not None
                        if isolated_seen:  # and what `diloco-node status` prints there
                            printed = islands[2].check_output([sys.executable, "-m", "diloco_node", "status",
                                                               str(c.status_url)])
                            assert "ISOLATED since" in printed, printed
                    time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
                solo_rounds = len(c.rounds) - c_rounds_before
                a_round_at_heal = max(a.rounds)
                healed = time.monotonic()
                islands[2].heal()
                a.wait_until(lambda at=a_round_at_heal: agreed_round(nodes, at) is not None, 180,
                             f"agreement after a {cut:.0f} s cut")
                took = time.monotonic() - healed
                agreed_at = c_egress.sample()[0]
                rates = windows([s for s in list(c_egress.samples) if cut_at <= s[0] <= agreed_at])
                shown = f"c's 1-second windows (kB/s) from the cut to the agreement: {[round(r / 1000) for r in rates]}"
                assert max(rates) <= 1.1 * CAP_BYTES, shown
                agreed = agreed_round(nodes, a_round_at_heal)
                assert agreed is not None
                rounds = agreed - a_round_at_heal
                figures.append((cut, rounds, took))
                print(f"cut={cut:.0f}s agreed after {rounds} round(s) of a, {took:.1f}s; "
                      f"c logged {solo_rounds} round(s) while cut off; its egress peaked at "
                      f"{max(rates) / CAP_BYTES:.2f} × its cap")
                assert rounds <= AGREE_WITHIN_ROUNDS, (cut, rounds, c.log_text()[-3000:])
                assert solo_rounds <= 2, f"c raced through {solo_rounds} rounds while cut off\n{c.log_text()[-3000:]}"
                if cut >= 30:
                    assert isolated_seen, f"c's status never said isolated during a {cut:.0f} s cut"
                assert c.status()["isolated"] is False
                assert all(node.process and node.process.poll() is None for node in nodes)
        rates = windows(c_egress.samples)
        # the cap was what held c's egress, not a slow exchange
        assert max(rates) >= 0.5 * CAP_BYTES, [round(r / 1000) for r in rates]
        log = c.log_text()
        assert log.count("isolated: no peer") <= len(CUTS), "the isolation is logged once per cut"
        assert "Traceback" not in log
        for node in nodes:
            node.stop("sigterm", within=60)
