"""PayloadExchange between two real hivemind DHT peers in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from hivemind import DHT

from diloco_node.swarm.exchange import PayloadExchange

pytestmark = pytest.mark.integration


@pytest.fixture
def pair() -> Iterator[tuple[PayloadExchange, PayloadExchange, str, str]]:
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    offering, fetching = PayloadExchange(first, "xtest", 1 << 20), PayloadExchange(second, "xtest", 1 << 20)
    yield offering, fetching, str(first.peer_id), str(second.peer_id)
    for exchange in (offering, fetching):
        exchange.close()
    second.shutdown()
    first.shutdown()


def test_drain_waits_until_the_group_has_fetched(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    offering, fetching, offering_id, fetching_id = pair
    offering.offer(1, b"payload")
    offering.expect(1, [fetching_id])
    assert not offering.drain(0.5, still_there=lambda _peer: True), "nobody fetched yet"

    drained: list[bool] = []
    waiter = threading.Thread(target=lambda: drained.append(offering.drain(30, still_there=lambda _peer: True)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "drain returned before the group member fetched"
    assert fetching.fetch_all([offering_id], 1, timeout=10) == {offering_id: b"payload"}
    waiter.join(timeout=10)
    assert drained == [True]


def test_drain_does_not_wait_for_peers_that_left(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    offering, _, _, fetching_id = pair
    offering.offer(1, b"payload")
    offering.expect(1, [fetching_id])
    started = time.monotonic()
    assert offering.drain(30, still_there=lambda _peer: False)
    assert time.monotonic() - started < 5


def test_a_fetch_before_we_knew_the_group_counts(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    # a fast group member can fetch before our own matchmaking returns and we call expect()
    offering, fetching, offering_id, fetching_id = pair
    offering.offer(1, b"payload")
    assert fetching.fetch_all([offering_id], 1, timeout=10) == {offering_id: b"payload"}
    offering.expect(1, [fetching_id])
    assert offering.drain(0.5, still_there=lambda _peer: True)
