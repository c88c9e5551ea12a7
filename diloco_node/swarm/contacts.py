"""Contacts: the peers a node can dial again after it has lost every one of them.

hivemind's DHT drops peers that stop answering from its routing table and never looks for them
again: a node whose link went down for a minute came back to an empty table and trained alone for
good (issue 18). So a node remembers how to reach peers — its --peer addresses, and every peer it
was connected to — and, while isolated, dials them and pings them into the DHT's routing table
(which makes them add us to theirs), then refreshes its neighbourhood from whoever answered.

Dialing needs the daemon's connect call, which hivemind's P2P exposes only on its private
`_client`: hivemind has no public way to re-bootstrap a running DHT node. Everything here runs
inside hivemind's DHT process through `DHT.run_coroutine`, so the functions are module-level
(they travel by reference).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from diloco_node.swarm import bounded

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 64  # peers kept to dial; the newest win
DIAL_TIMEOUT = 3.0

Book = dict[str, list[str]]  # peer id → its transport addresses


def parse_peer_addresses(addresses: Iterable[str]) -> Book:
    """--peer multiaddrs (/ip4/…/tcp/…/p2p/<id>) → {peer id: [transport address]}."""
    book: Book = {}
    for address in addresses:
        multiaddr = Multiaddr(address)
        peer_id = multiaddr.value_for_protocol("p2p")
        book.setdefault(peer_id, []).append(str(multiaddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))))
    return book


async def _connected_peers(_dht: DHT, node: DHTNode) -> Book:
    return {info.peer_id.to_base58(): [str(a) for a in info.addrs] for info in await node.p2p.list_peers()}


def _tcp_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a plain TCP multiaddr (/ip4|/ip6|/dns*/…/tcp/…), else None."""
    multiaddr = Multiaddr(address)
    names = [p.name for p in multiaddr.protocols()]
    if len(names) != 2 or names[1] != "tcp" or names[0] not in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return None
    return multiaddr.value_for_protocol(names[0]), int(multiaddr.value_for_protocol("tcp"))


async def _answers(address: str) -> bool:
    """Whether a TCP connection to `address` opens (True where it cannot be probed so)."""
    endpoint = _tcp_endpoint(address)
    if endpoint is None:
        return True
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*endpoint), DIAL_TIMEOUT)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


async def _dial(book: Book, _dht: DHT, node: DHTNode) -> list[str]:
    """Connect to and ping every peer in `book`; the ids of those that answered."""

    async def one(peer: str, addresses: list[str]) -> bool:
        peer_id = PeerID.from_base58(peer)
        # Probe with a bare TCP connection first and ask the libp2p daemon to dial only an address
        # that answers: every dial the daemon sees fail backs that peer off for longer and longer
        # (5 s + tries² s, up to 5 minutes), which after a long cut kept a node from its peers for
        # a minute after the link was back.
        reachable = [a for a, ok in zip(addresses, await asyncio.gather(*map(_answers, addresses)), strict=True)
                     if ok]
        if not reachable:
            return False
        try:
            # Drop what is left of the old connection first: after a long cut its TCP connection is
            # still "open" but deep in retransmission backoff (a minute or more between tries), and
            # connect would reuse it instead of dialing afresh.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.p2p._client.disconnect(peer_id), DIAL_TIMEOUT)
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [Multiaddr(a) for a in reachable]), DIAL_TIMEOUT)
            return await asyncio.wait_for(node.protocol.call_ping(peer_id), DIAL_TIMEOUT) is not None
        except Exception as exc:  # unreachable, refused, timed out: the next attempt tries again
            logger.debug("dial peer=%s failed: %r", peer, exc)
            return False

    answered = await asyncio.gather(*(one(peer, addresses) for peer, addresses in book.items()))
    reached = [peer for peer, ok in zip(book, answered, strict=True) if ok]
    if reached:  # refill the routing table around us from those who answered
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), DIAL_TIMEOUT)
        except Exception:
            pass
    return reached


class Contacts:
    """Where to find peers again. Not thread-safe: the presence heartbeat thread alone uses it."""

    def __init__(self, dht: DHT, peer_id: str, initial_peers: Iterable[str]):
        self._dht, self._peer_id = dht, peer_id
        self._initial = parse_peer_addresses(initial_peers)
        self._seen: Book = {}

    def remember_connected(self) -> None:
        """Note how to reach the peers we are connected to now."""
        for peer, addresses in bounded.run_coroutine(self._dht, _connected_peers).items():
            if addresses and peer != self._peer_id:
                self._seen.pop(peer, None)
                self._seen[peer] = addresses  # re-inserted: the newest last
        while len(self._seen) > MAX_REMEMBERED:
            self._seen.pop(next(iter(self._seen)))

    def dial(self) -> list[str]:
        """Dial every contact once; the peer ids that answered."""
        book = {**self._seen, **self._initial}
        book.pop(self._peer_id, None)
        return bounded.run_coroutine(self._dht, functools.partial(_dial, book)) if book else []
