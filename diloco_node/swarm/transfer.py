"""The transfer of one round's encoded pseudo-gradients within a known group: all-gather
(exchange.py) for small groups, butterfly (butterfly.py) from `butterfly_from` members or when a
member cannot be dialled. Bytes only: what they mean is outer/'s business."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

from diloco_node.round import Gathered, Outcome, PartSource, Reduced
from diloco_node.swarm.butterfly import BEYOND_TIMEOUT, Butterfly, owners
from diloco_node.swarm.dht import SwarmSettings
from diloco_node.swarm.exchange import Fetched, PayloadExchange
from diloco_node.swarm.matchmaking import GROUP_POLL_SECONDS
from diloco_node.swarm.presence import Presence
from diloco_node.swarm.spread import Spread
from diloco_node.swarm.streams import Streams
from diloco_node.trust.view import catch_up_refusal

logger = logging.getLogger(__name__)

# A leaving node waits this long for its last butterfly group to read the part it averaged (their
# pushes are answered as soon as it reduced the part: this is only the answers still on the wire)
ANSWER_DRAIN_SECONDS = 10.0
EXCHANGE_SLACK = BEYOND_TIMEOUT + 5.0  # a butterfly's longest, beyond the round timeout
# The most members a group of a DiLoCo run may name when a joiner completes or catches up a round
# from it (NoLoCo: --group-size): as large as the config lets a run ask (--min-group-size ≤ 64). A
# server's group is its own word, and every member named is fetched and decoded at once: 256 ids
# cost +1.06 GiB for a 4 MiB model (docs/architecture.md §9).
MAX_RUN_GROUP = 64


class Transfer:
    def __init__(self, settings: SwarmSettings, peer_id: str, client: bool, numel: int, presence: Presence,
                 streams: Streams, exchange: PayloadExchange, butterfly: Butterfly):
        self.settings, self.peer_id, self.client, self._numel = settings, peer_id, client, numel
        self._presence, self._streams, self._exchange, self._butterfly = presence, streams, exchange, butterfly
        self._sources: dict[int, PartSource] = {}  # butterfly: what we bring to each round we offered

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: PartSource | None = None,
              spread: Spread | None = None) -> None:
        """`spread`: our payload's serving paced across the next round (spread.py); a butterfly's
        parts are pushed at the cap (docs/architecture.md §15)."""
        if payload is not None:
            self._exchange.offer(round_, payload, tokens, spread)
        if parts is not None:
            self._sources[round_] = parts
            for old in [r for r in self._sources if r < round_ - 2]:
                del self._sources[old]

    def clients(self, group: Collection[str]) -> list[str]:
        """The members of `group` that accept no inbound connection (reachability.py)."""
        return sorted(p for p in group if (p == self.peer_id and self.client) or
                      (p != self.peer_id and (record := self._presence.known(p)) is not None and record.client))

    def by_butterfly(self, group: Collection[str]) -> bool:
        """Whether `group` exchanges by butterfly: big enough for it, or holding a client (nobody can
        fetch a client's payload). Every member decides alike from the group and the run's config."""
        threshold = self.settings.butterfly_from
        big = threshold is not None and len(group) >= threshold
        return big or (self.settings.butterfly_possible and bool(self.clients(group)))

    def butterfly_for(self, round_: int, group: Collection[str]) -> PartSource | None:
        """What we bring to `round_`'s butterfly, when `group` exchanges by butterfly."""
        return self._sources.get(round_) if self.by_butterfly(group) else None

    def alone(self, round_: int) -> None:
        """Our offer says we average `round_` alone: a joiner that took our state with this round in
        flight completes it from our payload at once, instead of waiting a round timeout for a group."""
        self._exchange.expect(round_, [self.peer_id], self.peer_id)

    def held(self, round_: int) -> None:
        """`round_` is held (round.held): nobody waits on us for a butterfly part."""
        self._streams.run(self._butterfly.close(round_), timeout=5)

    def move(self, round_: int, outcome: Outcome, others: list[str], fetched: dict[str, Fetched | None],
             contributing: bool, stop: threading.Event) -> Gathered:
        """Exchange `round_`'s payloads with `others` (any already `fetched` are not asked again)."""
        started = time.perf_counter()  # the transfer, once the group is known
        group = [self.peer_id, *others]
        if (source := self.butterfly_for(round_, group)) is not None:
            self._exchange.expect(round_, group, self.peer_id, fetched=False)
            clients = self.clients(group)
            if len(clients) == len(group):
                logger.warning("round=%d our group holds only clients, which cannot reach one another", round_)
                return Gathered(Outcome.ALONE, round_)
            try:
                reduced = self._streams.run(self._butterfly.exchange(
                    round_, group, self.peer_id, clients, source.numel or self._numel, source,
                    self.settings.round_timeout), timeout=self.settings.round_timeout + EXCHANGE_SLACK, stop=stop)
            except TimeoutError:
                return Gathered(Outcome.STOPPED if stop.is_set() else outcome, round_)
            return Gathered(outcome, round_, {}, time.perf_counter() - started,
                            sum(len(part) for part, _ in reduced.parts.values()), reduced)
        self._streams.run(self._butterfly.close(round_), timeout=5)  # nobody waits on us for a part
        if contributing:
            self._exchange.expect(round_, group, self.peer_id)
        fetched.update(self._exchange.fetch_all([p for p in others if p not in fetched], round_,
                                                self.settings.round_timeout))
        payloads = {peer: (item.payload, item.tokens) for peer, item in fetched.items() if item is not None}
        return Gathered(outcome, round_, payloads, time.perf_counter() - started,
                        sum(len(payload) for payload, _ in payloads.values()))

    def group_bound(self) -> int:
        """The most members a group of this run has: NoLoCo's --group-size, else MAX_RUN_GROUP."""
        return self.settings.group_size or MAX_RUN_GROUP

    def group_of(self, round_: int, member: str) -> Gathered:
        """The payloads `member`'s group averaged in `round_`, `member`'s own included, fetched from
        them (offers stay up for a few rounds): how a joiner completes a round its server had in
        flight when it shared its state. Empty when `member` has not formed that group (yet)."""
        deadline = time.monotonic() + self.settings.round_timeout
        while True:  # its group is known once its matchmaking has ended, which may still be under way
            probe = self._exchange.fetch_all([member], round_, self.settings.round_timeout,
                                             group_only=True).get(member)
            if probe is None or (probe.group is not None and member in probe.group):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(GROUP_POLL_SECONDS)
        if probe is None or probe.group is None or member not in probe.group:
            return Gathered(Outcome.ALONE, round_)
        group = probe.group
        butterfly = self.by_butterfly(group)
        refusal = catch_up_refusal(group, self.group_bound(),
                                   lambda: () if butterfly else self._presence.strangers_in(group))
        if refusal:  # nothing of it fetched: the round is lost for us, and said so
            logger.warning("round=%d peer=%s %s: its mean is not completed", round_, member, refusal)
            return Gathered(Outcome.ALONE, round_)
        if butterfly:
            return self._parts_held_by(member, round_, deadline)
        others = [peer for peer in group if peer != self.peer_id]
        fetched = self._exchange.fetch_all(others, round_, self.settings.round_timeout)
        if self.peer_id in group:  # a re-sync mid-round: the round in flight is one we averaged in
            fetched[self.peer_id] = self._exchange.own(round_)
        missing = sorted(peer for peer in group if fetched.get(peer) is None)
        if missing:  # a mean over fewer payloads is not the one `member` applied: lost, and said so
            logger.warning("round=%d the payloads of %s in peer=%s's group are gone; its mean cannot be "
                           "completed", round_, ", ".join(missing), member)
            return Gathered(Outcome.ALONE, round_)
        payloads = {peer: (item.payload, item.tokens) for peer, item in fetched.items() if item is not None}
        return Gathered(Outcome.TOGETHER, round_, payloads)

    def _parts_held_by(self, member: str, round_: int, deadline: float) -> Gathered:
        """The averaged parts of a butterfly round `member` took part in, once its exchange has ended."""
        while True:
            try:
                held = self._streams.run(self._butterfly.fetch_parts(member, round_, self.settings.round_timeout,
                                                                     self.group_bound()),
                                         timeout=self.settings.round_timeout)
            except Exception as exc:  # a network or peer failure: that round is lost for us
                logger.warning("round=%d could not fetch the averaged parts from peer=%s: %s", round_, member,
                               type(exc).__name__)
                return Gathered(Outcome.ALONE, round_)
            if held is not None:
                group, parts = held
                return Gathered(Outcome.TOGETHER, round_, reduced=Reduced(group, len(owners(group)), parts, None))
            if time.monotonic() > deadline:
                return Gathered(Outcome.ALONE, round_)
            time.sleep(GROUP_POLL_SECONDS)

    def drain(self, may_still_fetch: Callable[[str, int], bool]) -> None:
        """Before leaving: let our last group fetch our payload and read the part we averaged."""
        if not self._exchange.drain(self.settings.round_timeout, may_still_fetch):
            logger.warning("leaving before every group member fetched our last pseudo-gradient")
        deadline = time.monotonic() + ANSWER_DRAIN_SECONDS
        while self._streams.run(self._butterfly.unanswered(), timeout=5):
            if time.monotonic() > deadline:
                logger.warning("leaving before every group member read the part we averaged")
                break
            time.sleep(GROUP_POLL_SECONDS / 2)
