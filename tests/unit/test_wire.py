"""Wire bytes: parsing `ss` output and keeping the counts of closed connections.

Real daemons are measured in tests/integration/test_swarm.py and against veth counters in
tests/network/test_dashboard_bytes.py."""

from __future__ import annotations

import os

from diloco_node.telemetry.wire import Connection, WireMeter, parse_ss

# Real `ss -tinpH` lines (addresses shortened): an IPv4 connection of a p2pd, one of another
# program, an IPv6 one without path-MTU figures, and a TIME-WAIT socket that has no owner.
SS_OUTPUT = """\
ESTAB 0      0      10.0.0.1:40537 10.0.0.2:42225 users:(("p2pd",pid=14824,fd=13))
\t bbr wscale:10,10 rto:204 rtt:3.238/5.835 mss:1448 pmtu:1500 rcvmss:536 advmss:1448 cwnd:25 \
bytes_sent:4298345 bytes_acked:4298346 bytes_received:8362984 segs_out:16736 segs_in:20845 data_segs_out:10721
ESTAB 0      0      10.0.0.1:22 10.0.0.9:5555 users:(("sshd",pid=99,fd=3))
\t cubic wscale:7,7 mss:1448 pmtu:1500 bytes_sent:10 bytes_received:20 segs_out:1 segs_in:1
ESTAB 0      0      [::1]:4001 [::1]:50000 users:(("p2pd",pid=14824,fd=14),("p2pd",pid=14824,fd=15))
\t ts sack cubic bytes_acked:1000 bytes_received:500 segs_out:10 segs_in:5
TIME-WAIT 0 0 10.0.0.1:1 10.0.0.2:2
\t cubic bytes_received:1 segs_out:1 segs_in:1
"""


def test_parse_ss_gives_every_segment_its_headers() -> None:
    connections = parse_ss(SS_OUTPUT)
    assert set(connections) == {("10.0.0.1:40537", "10.0.0.2:42225", 14824), ("10.0.0.1:22", "10.0.0.9:5555", 99),
                                ("[::1]:4001", "[::1]:50000", 14824)}
    ipv4 = connections[("10.0.0.1:40537", "10.0.0.2:42225", 14824)]
    header = 14 + (1500 - 1448)  # ethernet + IP/TCP with timestamps, from path MTU less segment size
    assert ipv4 == Connection(sent=4298345 + header * 16736, received=8362984 + header * 20845)
    ipv6 = connections[("[::1]:4001", "[::1]:50000", 14824)]
    assert ipv6 == Connection(sent=1000 + (14 + 40 + 20 + 12) * 10, received=500 + (14 + 40 + 20 + 12) * 5)


def test_parse_ss_ignores_garbage() -> None:
    assert parse_ss("") == {}
    assert parse_ss("nonsense\n\t bytes_sent:x\nESTAB 0 0 a b\n") == {}


def test_closed_connections_keep_their_counts() -> None:
    meter = WireMeter(os.getpid())
    a, b = ("x:1", "y:2", 1), ("x:3", "y:4", 1)
    meter.absorb({a: Connection(100, 50)})
    meter.absorb({a: Connection(150, 60), b: Connection(10, 10)})
    assert meter.totals() in (None, (160, 70))
    meter.absorb({b: Connection(20, 30)})  # a closed: its last counts stay
    assert meter.totals() in (None, (170, 90))
    meter.absorb({b: Connection(5, 5)})  # the same address pair, a new connection
    assert meter.totals() in (None, (175, 95))
