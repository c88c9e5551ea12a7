"""A peer for tests/network/test_hosts.py, run inside an island: `serve ADDRESS` attaches a stream
service that lets each host group's strangers hold one stream, answers each stream with the host it
counted it against and holds it; `ask ADDRESS SERVER N` opens N streams to SERVER, printing one line
per stream (`served <group>` or `refused`). Both run until their stdin closes."""

from __future__ import annotations

import asyncio
import sys

from hivemind import DHT

from diloco_node.swarm.streams import PEER_FAILURES, Limits, Streams, StreamService, receive, send

HANDLER = "host_test"


class Held(StreamService):
    async def _serve(self, info, reader, writer) -> None:  # type: ignore[no-untyped-def]
        await send(writer, str(self._streams_served[-1].host).encode())
        await asyncio.sleep(3600)


def serve(address: str) -> None:
    dht = DHT(host_maddrs=[f"/ip4/{address}/tcp/0"], start=True)
    streams = Streams(dht)
    Held(streams, HANDLER, Limits(per_peer=4, total=4, rate=100.0, burst=100.0, reserved=0, per_host=1)).attach()
    print(next(str(a) for a in dht.get_visible_maddrs() if address in str(a)), flush=True)
    sys.stdin.read()


def ask(address: str, server: str, count: int) -> None:
    dht = DHT(host_maddrs=[f"/ip4/{address}/tcp/0"], initial_peers=[server], start=True)
    streams = Streams(dht)
    peer = server.rsplit("/p2p/", 1)[1]
    held = []

    async def one() -> str:
        from hivemind.p2p import PeerID

        _, reader, writer = await streams.p2p.call_binary_stream_handler(PeerID.from_base58(peer), HANDLER)
        held.append(writer)  # kept open: the stream keeps its slot
        try:
            return f"served {(await receive(reader, 64, timeout=10)).decode()}"
        except PEER_FAILURES:
            return "refused"

    for _ in range(count):
        print(streams.run(one(), timeout=30), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        ask(sys.argv[2], sys.argv[3], int(sys.argv[4]))
