"""All-gather of encoded pseudo-gradients over hivemind's libp2p streams.

Why all-gather rather than hivemind's butterfly all-reduce: every node then holds every
contribution, so it can reject and clip them one by one (robust mean), compressed payloads are
never re-quantized by a reducer, and all nodes compute the mean with identical operations — the
butterfly adds (mean − local) to the local value, which leaves φ different by a few ulps per node.
For the small groups DiLoCo averages in, the extra traffic is (M−1)/M·2 → (M−1) payloads; at M=2
it is the same.

Each node *offers* its payload for a round and *fetches* the others' payloads from them (pull),
through one stream handler on the P2P daemon hivemind already runs for the DHT (swarm/streams.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from diloco_node.rates import format_rate
from diloco_node.swarm.messages import MAX_DECLARED, PayloadRequest, parse_payload_request, peer_ids
from diloco_node.swarm.spread import Spread, pace_for, send_paced
from diloco_node.swarm.streams import HEADER_LEN, PEER_FAILURES, Streams, StreamService, parse_json, receive, send
from diloco_node.swarm.throttle import TokenBucket
from diloco_node.trust.state import CATCH_UP_ROUNDS

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 2048  # the round and the fetcher's admission token
MAX_META_BYTES = 1 << 14  # tokens and the group's peer ids
FETCH_RETRY_SECONDS = 10.0  # how long a transiently failing fetch is retried (a dead peer costs this much)
# a slow peer may still fetch the previous round while we offer the next, and a joiner the round
# its server had in flight when it shared its state (OverlappedUpdate.inherit)
KEPT_ROUNDS = 3
# An offer a group member has not fetched yet stays longer: that member may be a node whose own
# matchmaking failed after ours counted it in, recovering the group once its timeout ends
# (matchmaking.Matchmaker._missed_group) while NoLoCo's other nodes have already moved a round or two on.
AWAITED_KEPT_ROUNDS = 5
# Where rounds are shorter than a state download, a joiner catches its state up on the rounds since
# from their groups' payloads (docs/architecture.md §14): an offer stays this long after it is made,
# but never beyond the most rounds a joiner catches up on (with KEPT_ROUNDS for the rounds in flight
# then). So memory holds at most about what the link moves in these seconds, or the KEPT_ROUNDS.
CATCH_UP_KEPT_SECONDS = 60.0
RECEIVED = b"\x01"  # a fetcher's acknowledgement: it read our whole payload
# How often one peer may have one round's payload from us: a fetch and its retries after cut
# streams (`_fetch`). Before the group is known any record holder may fetch, and re-fetching as often
# as the rate limit allowed let 32 requests of 640 B pull 128 MiB.
MAX_SENDS_PER_PEER = 4


@dataclass
class _Offer:
    """What we offer for one round, and who has fetched it."""

    payload: bytes
    tokens: float
    made: float = field(default_factory=time.monotonic)
    group: tuple[str, ...] | None = None  # the round's group, ourselves included, once matchmaking told us
    awaited: set[str] = field(default_factory=set)  # members that have not fetched yet (see drain)
    served: set[str] = field(default_factory=set)  # peers that fetched it (before or after we knew the group)
    sends: dict[str, int] = field(default_factory=dict)  # peer → payloads of it we began to send (MAX_SENDS_PER_PEER)
    # served through the node's payload pace (spread.py): the last two rounds' offers are; an older
    # one (a joiner catching up, docs/architecture.md §14) goes at the upload cap
    paced: bool = True

    def meta(self) -> bytes:
        return json.dumps({"tokens": self.tokens, "group": self.group}).encode()


@dataclass(frozen=True)
class Fetched:
    """A peer's payload for a round, with its tokens and the group it averaged in (None if not yet known)."""

    payload: bytes
    tokens: float
    group: tuple[str, ...] | None


# Why `peer`, showing admission `token`, may not fetch our payload of `round` whose group (None:
# not known yet) is `group`; None when it may. Runs off the event loop: it may look up the DHT.
FetchPolicy = Callable[[str, int, str, "tuple[str, ...] | None"], "str | None"]


class PayloadExchange(StreamService):
    def __init__(self, streams: Streams, namespace: str, max_payload_bytes: int, may_fetch: FetchPolicy,
                 token: str = ""):
        """`token`: our admission, shown with each fetch (permissioned runs). Bytes moved are
        counted in `streams`."""
        super().__init__(streams, f"{namespace}_payload")
        self._max_payload = max_payload_bytes
        self._may_fetch, self._token = may_fetch, token
        self._offers: dict[int, _Offer] = {}
        self._offers_changed = threading.Condition()
        self._spread_said = False
        self._pace = TokenBucket(0.0)  # our payload serving's pace, set by each offer (spread.py)

    # --- serving ------------------------------------------------------------------------------

    def offer(self, round_: int, payload: bytes, tokens: float, spread: Spread | None = None) -> None:
        """Serve `payload` for `round_`; with `spread`, paced across the next round (spread.py)."""
        pace = pace_for(spread, len(payload), self.streams.throttle.upload.rate)
        if spread is not None and not self._spread_said:
            self._say_spread(round_, spread, len(payload), pace)
        self._pace.set_rate(pace)
        with self._offers_changed:
            for old, older in self._offers.items():
                older.paced = older.paced and old >= round_ - 1
            self._offers[round_] = _Offer(payload, tokens)
            now = time.monotonic()
            for old, kept in list(self._offers.items()):
                if old <= round_ - (AWAITED_KEPT_ROUNDS if kept.awaited else KEPT_ROUNDS) and \
                        (now - kept.made > CATCH_UP_KEPT_SECONDS or old <= round_ - CATCH_UP_ROUNDS - KEPT_ROUNDS):
                    del self._offers[old]

    def _say_spread(self, round_: int, spread: Spread, size: int, pace: float) -> None:
        """The planning line of the spread, once: the pace it chose and from what."""
        self._spread_said = True
        cap = self.streams.throttle.upload_limit
        logger.info("round=%d serving each payload across the round: %.2f MB x %d receiver(s) over %.1fs of "
                    "a %.1fs round = %s%s", round_, size / 1e6, spread.receivers, spread.window, spread.expected,
                    format_rate(spread.rate(size)),
                    f" (under the upload cap {format_rate(cap)})" if pace and cap else
                    "" if pace else f", not under the upload cap {format_rate(cap)} (its streams' share): "
                                    "served at the cap")

    def in_group(self, peer: str) -> bool:
        """Whether `peer` is in the group of a round whose offer we keep (Streams.trusted)."""
        with self._offers_changed:
            return any(offer.group is not None and peer in offer.group for offer in self._offers.values())

    def expect(self, round_: int, group: Sequence[str], ourselves: str, fetched: bool = True) -> None:
        """`group` (ourselves included) averages `round_`: each other member will fetch our payload
        (`fetched`; a butterfly's members do not, but a joiner may still ask us for the group)."""
        with self._offers_changed:
            if offer := self._offers.get(round_):
                offer.group = tuple(sorted(group))
                offer.awaited = set(group) - offer.served - {ourselves} if fetched else set()
                self._offers_changed.notify_all()

    def own(self, round_: int) -> Fetched | None:
        """What we offer for `round_`, as a peer fetching it would get it; None when we offer nothing."""
        with self._offers_changed:
            offer = self._offers.get(round_)
            return Fetched(offer.payload, offer.tokens, offer.group) if offer else None

    def served(self, round_: int, timeout: float) -> set[str]:
        """The peers that fetched our payload for `round_`, waiting up to `timeout` s for the first."""
        deadline = time.monotonic() + timeout
        with self._offers_changed:
            while True:
                offer = self._offers.get(round_)
                left = deadline - time.monotonic()
                if offer is None or offer.served or left <= 0:
                    return set(offer.served) if offer else set()
                self._offers_changed.wait(min(left, 1.0))

    def drain(self, timeout: float, may_still_fetch: Callable[[str, int], bool]) -> bool:
        """Wait until our group has fetched what we offered; True when nobody is left waiting.

        A node that leaves right after its last round would otherwise take its payload with it
        while a slower group member is still fetching it, and that member's φ would split off.
        Members that will not fetch a round's offer any more (`may_still_fetch(peer, round)` says
        no: they left the run, or finished that round without it) are not waited for.
        """
        deadline = time.monotonic() + timeout
        told = False
        with self._offers_changed:
            while True:
                waiting = {peer for round_, offer in self._offers.items() for peer in offer.awaited
                           if may_still_fetch(peer, round_)}
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    return not waiting
                if not told:  # so that a stop that takes a while says why
                    logger.info("waiting up to %.0fs for %d group member(s) to fetch our last pseudo-gradient",
                                left, len(waiting))
                    told = True
                self._offers_changed.wait(min(left, 1.0))

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await receive(reader, MAX_REQUEST_BYTES, timeout=10)
            asked, peer = parse_payload_request(request), str(info.peer_id)
            if isinstance(asked, str):
                raise ValueError(asked)
            round_, token = asked.round, asked.token
            with self._offers_changed:
                offer = self._offers.get(round_)
                group = offer.group if offer else None
            if offer is not None:
                why = await self.loop.run_in_executor(None, self._may_fetch, peer, round_, token, group)
                if why is not None:
                    self._refuse_once(peer, why, "round=%d refused our payload to peer=%s: %s", round_, peer, why)
                    offer = None
            with self._offers_changed:
                if offer is not None and not asked.group_only and offer.sends.get(peer, 0) >= MAX_SENDS_PER_PEER:
                    why = f"sent {MAX_SENDS_PER_PEER} times already"
                    self._refuse_once(peer, why, "round=%d refused our payload to peer=%s: %s", round_, peer, why)
                    offer = None
                meta, payload = (offer.meta(), offer.payload) if offer else (b"{}", b"")
                pace = self._pace if offer and offer.paced and self._pace.rate > 0 else None
                if asked.group_only:
                    payload = b""
                elif offer is not None:
                    offer.sends[peer] = offer.sends.get(peer, 0) + 1
            await send(writer, meta)
            await send_paced(writer, payload, pace)
            # served only once the fetcher says it read everything (its end closes either way)
            acknowledged = await asyncio.wait_for(reader.read(1), timeout=10) == RECEIVED
            if acknowledged and offer is not None and not asked.group_only:
                with self._offers_changed:
                    offer.served.add(str(info.peer_id))
                    offer.awaited.discard(str(info.peer_id))
                    self._offers_changed.notify_all()
            self.streams.count(sent=2 * HEADER_LEN + len(meta) + len(payload),
                                 received=HEADER_LEN + len(request) + acknowledged)
        except PEER_FAILURES as exc:
            logger.warning("payload request failed: %s", type(exc).__name__)
        finally:
            writer.close()

    # --- fetching -----------------------------------------------------------------------------

    def fetch_all(self, peers: Sequence[str], round_: int, timeout: float,
                  group_only: bool = False) -> dict[str, Fetched | None]:
        """Each peer's payload for `round_`, or None where it failed, timed out or had none;
        `group_only`: its tokens and group, with an empty payload (a poll for a group being formed
        must not move the payload each time: a joiner polling through its server's 20-s matchmaking
        moved 53 MB of a 1.6 MB payload)."""
        async def fetch_every() -> list[Fetched | None]:
            return await asyncio.gather(*(self._fetch(peer, round_, timeout, group_only) for peer in peers))
        try:
            results = self.streams.run(fetch_every(), timeout=timeout + 5)
        except TimeoutError:
            results = [None] * len(peers)
        return dict(zip(peers, results, strict=True))

    async def _fetch(self, peer: str, round_: int, timeout: float, group_only: bool = False) -> Fetched | None:
        """One peer's payload; a transient failure is retried for a while, since one lost payload
        splits φ: a stream cut short, or the daemon not reaching a peer whose link just came back
        (seen after a partition healed: ControlFailure, and the group's φ split)."""
        deadline = self.loop.time() + timeout
        give_up = min(deadline, self.loop.time() + FETCH_RETRY_SECONDS)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._fetch_once(peer, round_, max(deadline - self.loop.time(), 1.0), group_only)
            except (asyncio.IncompleteReadError, ConnectionError, P2PDaemonError) as exc:
                if self.loop.time() >= give_up:
                    return self._failed(peer, round_, exc)
                if attempt == 1:
                    logger.info("round=%d retrying fetch from peer=%s after %s", round_, peer, type(exc).__name__)
                await asyncio.sleep(min(0.2 * attempt, 1.0))
            except Exception as exc:  # any other network or peer failure only drops this peer's contribution
                return self._failed(peer, round_, exc)

    @staticmethod
    def _failed(peer: str, round_: int, exc: Exception) -> None:
        logger.warning("round=%d could not fetch payload from peer=%s: %s", round_, peer, type(exc).__name__)

    async def _fetch_once(self, peer: str, round_: int, timeout: float, group_only: bool = False) -> Fetched | None:
        reader, writer = await self._open(peer, self.name, timeout)
        try:
            request = PayloadRequest(round_, self._token, group_only).encode()
            await send(writer, request)
            meta = await receive(reader, MAX_META_BYTES, timeout)
            payload = await receive(reader, self._max_payload, timeout)
            writer.write(RECEIVED)
            await writer.drain()
        finally:
            writer.close()
        self.streams.count(sent=HEADER_LEN + len(request) + len(RECEIVED),
                           received=2 * HEADER_LEN + len(meta) + len(payload))
        fields = parse_json(meta)
        if not payload and not (group_only and fields):  # no offer: its meta is empty too
            return None
        tokens, group = _parse_meta(fields)
        return Fetched(b"" if group_only else payload, tokens, group)


def _parse_meta(meta: Any) -> tuple[float, tuple[str, ...] | None]:
    """A peer's (tokens, group) for its payload; ValueError on anything else."""
    tokens = meta.get("tokens") if isinstance(meta, dict) else None
    # in range before math.isfinite, which raises OverflowError for an int beyond a float's range
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not 0 < tokens <= MAX_DECLARED \
            or not math.isfinite(tokens):
        raise ValueError(f"payload tokens {str(tokens)[:20]!r} are not a positive number in range")
    group = meta.get("group")
    members = peer_ids(group) if group is not None else None
    if group is not None and members is None:
        raise ValueError("payload group is not a list of distinct peer ids")
    return float(tokens), members
