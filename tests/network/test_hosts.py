"""Strangers bounded by the host their connection comes from, between real hivemind peers on three
islands (swarm/hosts.py, streams.Limits.per_host; docs/architecture.md §9): the address a handler
counts a stream against is its connection's, so a second stream of one host is refused while a
stranger of another host is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.islands import Islands
from tests.network.test_islands import need_netns

PEER = str(Path(__file__).with_name("host_peer.py"))


def test_a_hosts_second_stranger_stream_is_refused_and_another_hosts_is_served() -> None:
    need_netns()
    with Islands(count=3, rate_mbit=100.0) as islands:
        server_island, first, second = islands
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

        def started(island, *args: str) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
            return island.run([sys.executable, PEER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)

        server = started(server_island, "serve", server_island.address)
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        asking = [started(first, "ask", first.address, address, "2"), started(second, "ask", second.address,
                                                                              address, "1")]
        lines = []
        for process, count in zip(asking, (2, 1), strict=True):
            assert process.stdout is not None
            lines.append([process.stdout.readline().strip() for _ in range(count)])
        assert lines == [[f"served {first.address}", "refused"], [f"served {second.address}"]]
        for process in (*asking, server):
            assert process.stdin is not None
            process.stdin.close()
            assert process.wait(timeout=30) == 0
