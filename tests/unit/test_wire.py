"""Wire bytes: tcp_info as link-layer bytes, the kernel's counters of real sockets, and keeping the
counts of closed connections.

Real daemons are measured in tests/integration/test_pair.py and against veth counters in
tests/network/test_dashboard_bytes.py."""

from __future__ import annotations

import os
import socket
import threading

from diloco_node.telemetry.wire import Connection, WireMeter, link_bytes, socket_inodes, tcp_connections


def test_every_segment_gets_its_headers() -> None:
    info = {"tcpi_pmtu": 1500, "tcpi_snd_mss": 1448, "tcpi_bytes_sent": 4298345, "tcpi_bytes_acked": 4298346,
            "tcpi_bytes_received": 8362984, "tcpi_segs_out": 16736, "tcpi_segs_in": 20845}
    header = 14 + (1500 - 1448)  # ethernet + IP/TCP with timestamps, from path MTU less segment size
    assert link_bytes(info, ipv6=False) == Connection(sent=4298345 + header * 16736, received=8362984 + header * 20845)


def test_without_path_mtu_headers_are_linux_defaults_and_old_kernels_count_acked_bytes() -> None:
    info = {"tcpi_bytes_acked": 1000, "tcpi_bytes_received": 500, "tcpi_segs_out": 10, "tcpi_segs_in": 5}
    header = 14 + 40 + 20 + 12
    assert link_bytes(info, ipv6=True) == Connection(sent=1000 + header * 10, received=500 + header * 5)


def test_the_kernel_counts_a_real_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            client.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(accepted.recv(1 << 20))
            mine = socket_inodes(os.getpid())
            assert os.fstat(client.fileno()).st_ino in mine
            connections = tcp_connections({os.fstat(client.fileno()).st_ino})
            assert len(connections) == 1
            (local, peer, _), counts = next(iter(connections.items()))
            assert local == "{}:{}".format(*client.getsockname()) and peer == "{}:{}".format(*server.getsockname())
            assert 100_000 < counts.sent < 120_000  # the payload plus its segments' headers
            assert tcp_connections(set()) == {}


def test_sampling_starts_no_thread_or_process() -> None:
    before = threading.active_count()
    meter = WireMeter(os.getpid())
    assert meter.available
    meter.sample()  # no p2pd descends from pytest: nothing measured, nothing spawned
    assert meter.totals() == (0, 0) and threading.active_count() == before


def test_closed_connections_keep_their_counts() -> None:
    meter = WireMeter(os.getpid())
    a, b = ("x:1", "y:2", 1), ("x:3", "y:4", 2)
    meter.absorb({a: Connection(100, 50)})
    meter.absorb({a: Connection(150, 60), b: Connection(10, 10)})
    assert meter.totals() == (160, 70)
    meter.absorb({b: Connection(20, 30)})  # a closed: its last counts stay
    assert meter.totals() == (170, 90)
    meter.absorb({b: Connection(5, 5)})  # the same address pair, a new connection
    assert meter.totals() == (175, 95)


def test_the_rate_is_taken_over_the_last_samples_spanning_the_window(monkeypatch) -> None:
    """The egress / ingress shown against the caps (docs/architecture.md §13): bytes/s between the
    newest sample and the newest one at least RATE_SECONDS older."""
    from diloco_node.telemetry import wire

    now = [100.0]
    monkeypatch.setattr(wire.time, "monotonic", lambda: now[0])
    meter = WireMeter(os.getpid())
    a = ("x:1", "y:2", 1)
    assert meter.rates() is None
    for second in range(6):  # 1000 B/s out, then 5000 B/s out in the last two seconds; 200 B/s in
        now[0] = 100.0 + second
        sent = 1000 * min(second, 3) + 5000 * max(second - 3, 0)
        meter.absorb({a: Connection(sent, 200 * second)})
    egress, ingress = meter.rates(span=3.0) or (0.0, 0.0)
    assert egress == (13000 - 2000) / 3 and ingress == 200
    assert meter.rates(span=1.0) == (5000, 200)
