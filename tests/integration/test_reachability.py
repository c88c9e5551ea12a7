"""Dial-back between real hivemind peers in this process (swarm/reachability.py); the NAT itself is
tests/network/test_nat.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hivemind import DHT

from diloco_node.swarm.reachability import DialBack, detect
from diloco_node.swarm.streams import Streams

pytestmark = pytest.mark.integration

NAMESPACE = "rtest"


@pytest.fixture
def answering() -> Iterator[DHT]:
    """A peer that dials back whoever asks."""
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    streams = Streams(dht)
    dial_back = DialBack(streams, NAMESPACE)
    dial_back.attach()
    yield dht
    dial_back.detach()
    streams.close()
    dht.shutdown()


def addresses_of(dht: DHT) -> list[str]:
    return [str(address) for address in dht.get_visible_maddrs()]


def test_a_node_on_a_reachable_address_is_told_so(answering: DHT) -> None:
    asking = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses_of(answering), start=True)
    try:
        assert detect(asking, NAMESPACE, addresses_of(answering)) is True
    finally:
        asking.shutdown()


def test_a_node_announcing_only_addresses_nobody_can_dial_is_not(answering: DHT) -> None:
    # a LAN address behind a NAT: the answering peer's connection attempt finds nothing there
    asking = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=["/ip4/127.0.0.1/tcp/1"],
                 initial_peers=addresses_of(answering), start=True)
    try:
        started = time.monotonic()
        assert detect(asking, NAMESPACE, addresses_of(answering)) is False
        assert time.monotonic() - started < 20
    finally:
        asking.shutdown()


def test_without_peers_to_ask_nothing_is_known() -> None:
    alone = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        assert detect(alone, NAMESPACE, []) is None
    finally:
        alone.shutdown()
