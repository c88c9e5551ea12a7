"""The address stream limits bound strangers by, between real hivemind peers in this process
(swarm/hosts.py, streams.Limits.per_host): the one the p2p daemon's connection comes from, which a
peer cannot choose as it chooses its id. Loopback peers are in no group (our own machine), so here
the bound itself is left to tests/unit/test_limits.py; this test holds the address it reads."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hivemind import DHT

from diloco_node.swarm.hosts import host_of
from diloco_node.swarm.streams import PEER_FAILURES, Limits, Streams, StreamService, receive, send

pytestmark = pytest.mark.integration


class Held(StreamService):
    """Answers with the host its stream comes from, then holds it until `release`."""

    def __init__(self, streams: Streams, limits: Limits):
        super().__init__(streams, "htest", limits)
        self.release = asyncio.Event()

    async def _serve(self, info, reader, writer) -> None:  # type: ignore[no-untyped-def]
        await send(writer, f"{host_of(info.addr)} {self._streams_served[-1].host}".encode())
        await self.release.wait()
        writer.close()


@pytest.fixture
def serving() -> Iterator[tuple[DHT, Streams, Held]]:
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    streams = Streams(dht)
    service = Held(streams, Limits(per_peer=4, total=4, rate=100.0, burst=100.0, reserved=0, per_host=1))
    service.attach()
    yield dht, streams, service
    streams.loop.call_soon_threadsafe(service.release.set)
    service.detach()
    streams.close()
    dht.shutdown()


def test_a_stream_is_counted_by_the_address_its_connection_comes_from(serving) -> None:  # type: ignore[no-untyped-def]
    dht, streams, _ = serving
    clients = [DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=[str(a) for a in dht.get_visible_maddrs()],
                   start=True) for host in ("127.0.0.2", "127.0.0.3")]
    opened = [Streams(client) for client in clients]
    try:
        async def first_message(client: Streams) -> bytes | None:
            _, reader, writer = await client.p2p.call_binary_stream_handler(streams.p2p.peer_id, "htest")
            try:
                return await receive(reader, 64, timeout=10)
            except PEER_FAILURES:  # closed before a byte: refused
                return None

        # each client's own address, whatever it dialled from; on our own machine, in no group, so a
        # second stream of one host is served past per_host = 1
        assert opened[0].run(first_message(opened[0]), timeout=30) == b"127.0.0.2 None"
        assert opened[0].run(first_message(opened[0]), timeout=30) == b"127.0.0.2 None"
        assert opened[1].run(first_message(opened[1]), timeout=30) == b"127.0.0.3 None"
    finally:
        for client_streams, client in zip(opened, clients, strict=True):
            client_streams.close()
            client.shutdown()
