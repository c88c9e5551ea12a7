"""Whether peers can open connections to us (volunteers behind a home NAT cannot accept any).

A node asks a peer it already reaches to dial it back: the peer opens a plain TCP connection to
each address we would announce and says which succeeded. A libp2p call would not do: it reuses the
connection we opened, which works through any NAT. A node that nobody can dial joins as a client
(swarm/butterfly.py): it pushes its parts and receives the averaged ones on streams it opens, owns
no part, and serves nothing (payloads, state).

The dial-back handler connects and closes, sends nothing, dials at most MAX_ADDRESSES addresses per
request, only on the host the asker's own connection comes from (a relayed asker gets nothing
dialled), and answers each peer at most once per ASK_INTERVAL seconds, so it cannot be turned into
a scanner or an amplifier of other hosts, whatever peer ids an asker makes up. (Records carry no
addresses, so the asker's connection is the address we know to be its own; docs/architecture.md §9.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence

from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from diloco_node.swarm import bounded
from diloco_node.swarm.hosts import host_of
from diloco_node.swarm.messages import parse_dial_back
from diloco_node.swarm.streams import PEER_FAILURES, Streams, StreamService, parse_json, receive, send

logger = logging.getLogger(__name__)

DIAL_TIMEOUT = 3.0
MAX_ADDRESSES = 8
MAX_REQUEST_BYTES = 4096
ASK_INTERVAL = 30.0  # seconds between two dial-backs for the same peer
PEERS_ASKED = 3
# A peer that cannot answer in this long (frozen, overloaded) is not waited for: start-up goes on
# (a SIGSTOPped peer held a joiner for 15 s, long enough for the joiner to find no state to download)
ASK_TIMEOUT = 5.0


def handler_name(namespace: str) -> str:
    return f"{namespace}_dialback"


class DialBack(StreamService):
    """The answering side, on the node's streams (P2P and event loop)."""

    def __init__(self, streams: Streams, namespace: str):
        super().__init__(streams, handler_name(namespace))
        self._last_asked: dict[str, float] = {}

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        try:
            addresses = parse_dial_back(await receive(reader, MAX_REQUEST_BYTES, timeout=10), MAX_ADDRESSES)
            if isinstance(addresses, str):
                raise ValueError(addresses)
            now = time.monotonic()
            if now - self._last_asked.get(peer, -ASK_INTERVAL) < ASK_INTERVAL:
                raise ValueError("asked again too soon")
            if len(self._last_asked) > 4096:  # forget the oldest askers: the table stays small
                self._last_asked = dict(sorted(self._last_asked.items(), key=lambda item: item[1])[-2048:])
            self._last_asked[peer] = now
            reached = await self._dial_own(host_of(getattr(info, "addr", None)), addresses)
            await send(writer, json.dumps({"reachable": list(reached)}).encode())
        except PEER_FAILURES as exc:
            self._refuse_once(peer, str(exc), "dial-back request from peer=%s refused: %s", peer, exc,
                              level=logging.INFO)
        finally:
            writer.close()


    @staticmethod
    async def _dial_own(asker: str | None, addresses: list[str]) -> list[bool]:
        """Dial the addresses on the asker's own host only. When it announces addresses of its
        connection's IP family but none on that host, it connects from elsewhere: behind a NAT, whose
        public address is not one it knows, so it is unreachable (answered without dialling other
        hosts). An empty answer (a relayed asker, or only addresses of another family) tells the
        asker nothing, which it takes as "cannot tell", not as "unreachable"."""
        if asker is None:
            return []
        own = [a for a in addresses if host_of(a) == asker]
        if own:
            return list(await asyncio.gather(*(_dial(a) for a in own)))
        same_family = [a for a in addresses if (host := host_of(a)) is not None and (":" in host) == (":" in asker)]
        return [False] if same_family else []


async def _dial(address: str) -> bool:
    """Whether a TCP connection to `address` (a /ip4|ip6/…/tcp/… multiaddr) opens."""
    try:
        parts = Multiaddr(address).items()
        host = next(value for protocol, value in parts if protocol.name in ("ip4", "ip6"))
        port = int(next(value for protocol, value in parts if protocol.name == "tcp"))
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
    except (OSError, TimeoutError, StopIteration, ValueError):
        return False
    writer.close()
    return True


def detect(dht: DHT, namespace: str, initial_peers: Sequence[str]) -> bool | None:
    """Whether a peer could dial us: True as soon as one says so, False when every peer asked
    answered and none could, None when nobody answered (we are the first node, or peers are old)."""
    peers = [address.split("/p2p/")[-1] for address in initial_peers if "/p2p/" in address][:PEERS_ASKED]
    addresses = bounded.visible_maddrs(dht)
    if not peers:
        return None

    async def ask_all() -> list[bool | None]:
        p2p = await dht.replicate_p2p()
        try:
            return list(await asyncio.gather(*(_ask(p2p, peer, namespace, addresses) for peer in peers)))
        finally:
            await p2p.shutdown()

    answers = asyncio.run(ask_all())
    if any(answers):
        return True
    return False if answers and all(answer is False for answer in answers) else None


async def _ask(p2p: P2P, peer: str, namespace: str, addresses: list[str]) -> bool | None:
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler_name(namespace)), ASK_TIMEOUT)
        try:
            await send(writer, json.dumps({"addresses": addresses[:MAX_ADDRESSES]}).encode())
            answer = parse_json(await receive(reader, MAX_REQUEST_BYTES, ASK_TIMEOUT))
        finally:
            writer.close()
        reached = answer.get("reachable") if isinstance(answer, dict) else None
        return any(reached) if isinstance(reached, list) and reached else None
    except Exception as exc:  # that peer cannot tell us: ask the others
        logger.info("peer=%s could not dial us back: %s", peer, type(exc).__name__)
        return None
