"""Matchmaking: who averages a round with us. Groups form through hivemind's DecentralizedAverager
(its DHT matchmaking, timeouts and retries find the peers averaging the same round); it only
all-reduces a one-element dummy, while the payloads travel through our own streams (transfer.py).
Rounds never mix: the matchmaking key carries the round number, and the run id + config
fingerprint are the averager's prefix. Also the recovery of a group that counted us in although
our own matchmaking failed, and NoLoCo's drawn groups.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.utils import get_dht_time

from diloco_node.round import Outcome, PartSource
from diloco_node.swarm import bounded
from diloco_node.swarm.butterfly import Butterfly
from diloco_node.swarm.dht import SwarmSettings
from diloco_node.swarm.exchange import Fetched, PayloadExchange
from diloco_node.swarm.groups import SPARE_KEY, group_key, random_groups
from diloco_node.swarm.pacing import pace_leader_search
from diloco_node.swarm.presence import Presence
from diloco_node.swarm.streams import Streams

logger = logging.getLogger(__name__)

pace_leader_search()  # before any averager is forked (swarm/pacing.py)

ROUND_BITS = 24  # group key bits carrying the round number (mod 2**24)
MATCHMAKING_SLACK = 5.0  # seconds beyond the matchmaking windows for DHT lookups on a loaded link
# After a failed matchmaking: how long a group that counted us in has to fetch our payload. Its
# members fetch as soon as their own matchmaking ends, which on a loaded machine can be two seconds
# after ours gave up (seen in CI: a fetch 75 ms past a 2 s grace, and the round split).
MISSED_GROUP_GRACE = 5.0
NEXT_CHUNK_TIMEOUT = 10.0  # hivemind's all-reduce: a member silent this long is dropped from it
# After our all-reduce failed (a group had formed): its leader waits up to two of those for our part
# before it completes without it, still counting us in (seen in CI: a fetch 9 s after our failure).
# We stop waiting sooner once every peer has finished the round without us.
MISSED_ALLREDUCE_GRACE = 2 * NEXT_CHUNK_TIMEOUT + 5.0
GROUP_POLL_SECONDS = 0.5  # between asks for a group whose matchmaking is under way
AVERAGER_EXIT_SECONDS = 5.0  # what a terminated averager gets to exit (it ends at SIGTERM's default)

# What we bring to a round's butterfly when its group exchanges by butterfly, else None (transfer.py)
ButterflyFor = Callable[[int, Collection[str]], PartSource | None]


def start_averager(dht: DHT, namespace: str, settings: SwarmSettings, client: bool) -> DecentralizedAverager:
    """hivemind's averager, which forks its process: started before any thread of ours."""
    averager = DecentralizedAverager(
        [torch.zeros(1)], dht, start=False, prefix=namespace,
        min_matchmaking_time=settings.matchmaking_time, request_timeout=min(3.0, settings.matchmaking_time / 2),
        next_chunk_timeout=NEXT_CHUNK_TIMEOUT, allreduce_timeout=settings.round_timeout, allow_state_sharing=False,
        target_group_size=settings.group_size, client_mode=client,
        # from 3 on, a pair is no group (round.held): a leader waits for a third member until the
        # step's timeout instead of assembling a pair at the end of its window
        min_group_size=settings.min_group_size)
    # hivemind's start=True waits for the averager's process without a limit
    try:
        averager.run_in_background(await_ready=True, timeout=bounded.AVERAGER_START_TIMEOUT)
    except TimeoutError:
        raise bounded.HelperTimeout(f"hivemind's averager process did not start within "
                                    f"{bounded.AVERAGER_START_TIMEOUT:.0f}s") from None
    return averager


def round_bits(round_: int, peer: str, groups: list[list[str]] | None, spare: bool = False) -> str:
    """The matchmaking key bits of `round_`: its number, and under NoLoCo (`groups`: the round's
    draw) our drawn group's index, so that only our drawn group shares the key (see groups.py), or
    the round's spare key (`spare`: our drawn partners were all dropped)."""
    bits = format(round_ % 2**ROUND_BITS, f"0{ROUND_BITS}b")
    if groups is None:
        return bits
    return bits + (SPARE_KEY if spare else group_key(peer, groups))


def formed_then_failed(exc: BaseException) -> bool:
    """Whether a failed step had found a group (its all-reduce failed): then the group's leader may
    still count us in, after its own wait for our part. hivemind raises the same AllreduceException
    when matchmaking found nobody at all ("could not find a group"), which is no group: taking it
    for one made a node alone with a record that never matchmakes (a forged copy of an honest
    record) wait MISSED_ALLREDUCE_GRACE every round, and two nodes that missed each other once
    stay out of step, each matchmaking while the other waited (seen: eager rounds of 38 s).
    The price: hivemind says the same when our join request timed out while a leader assembled
    its group with us in it; that leader's fetch of our payload, if later than MISSED_GROUP_GRACE,
    is missed, our φ and the group's split for the round and the next digest check re-syncs us
    (a lost round, docs/architecture.md §9)."""
    return isinstance(exc, AllreduceException) and "could not find a group" not in str(exc)


class Matchmaker:
    def __init__(self, averager: DecentralizedAverager, settings: SwarmSettings, peer_id: str, presence: Presence,
                 streams: Streams, exchange: PayloadExchange, butterfly: Butterfly, butterfly_for: ButterflyFor):
        self.settings, self.peer_id, self.presence = settings, peer_id, presence
        self._streams, self._exchange, self._butterfly = streams, exchange, butterfly
        self._butterfly_for = butterfly_for
        self._averager = averager
        # hivemind's averager talks to its process over a pipe that is not safe to share between
        # threads; the exchange may run on a background thread (sync modes), so every call is locked.
        self._averager_lock = threading.Lock()
        self._draw: tuple[int, list[list[str]]] | None = None  # NoLoCo: the last round's groups

    def group_for(self, round_: int, contributing: bool, spare: bool = False,
                  strangers: bool = False) -> tuple[list[str], dict[str, Fetched | None]]:
        """The other members of our group for `round_` (none: we average alone), and any payloads
        already fetched from them; a NoLoCo pair that missed each other tries once more. `spare`:
        NoLoCo, under the round's spare key (groups.SPARE_KEY) rather than our drawn group's.
        `strangers`: no peer about is proven or new (trust/view.py: Partners.strangers)."""
        others, fetched = self._find_group(round_, contributing, spare, strangers)
        if not others and contributing and not spare and self._drawn_group_failed_too(round_):
            logger.info("round=%d matchmaking failed for our whole drawn group; trying once more", round_)
            others, fetched = self._find_group(round_, contributing)
        if not others:
            logger.warning("round=%d no peer averaged with us", round_)
        return others, fetched

    def drawn_groups(self, round_: int) -> list[list[str]]:
        """NoLoCo: the groups of `round_` as we see the run, drawn once per round so that waiting
        for our group and matchmaking with it agree even if a peer joins or leaves in between."""
        assert self.settings.group_size, "groups are drawn for NoLoCo only"
        if self._draw is None or self._draw[0] != round_:
            # A node that left after exchanging this round still counts: nodes that draw after it
            # left then draw the same groups as those that drew before (a run's end, a volunteer's Ctrl-C).
            peers = [*self.presence.compatible_peers(), *self.presence.departed_after(round_)]
            # from 3 on, no drawn group is smaller than --min-group-size (it would be held, round.held)
            least = self.settings.min_group_size if self.settings.min_group_size > 2 else 1
            self._draw = (round_, random_groups(peers, self.settings.run_id, round_, self.settings.group_size, least))
        return self._draw[1]

    def drawn_group(self, round_: int) -> list[str]:
        """NoLoCo: who we are drawn to average with in `round_`, ourselves included."""
        return next((group for group in self.drawn_groups(round_) if self.peer_id in group), [self.peer_id])

    def _find_group(self, round_: int, contributing: bool, spare: bool = False,
                    strangers: bool = False) -> tuple[list[str], dict[str, Fetched | None]]:
        """The other members of our group for `round_`, and any payloads already fetched from them.
        With only `strangers` about, a matchmaking that found nobody looks for no group that
        counted us in: a peer that could have is one whose record also claims it may still fetch
        (a copy of an honest record does), and unproven peers decide nothing (trust/proofs.py)."""
        group, formed = self._form_group(round_, spare)
        others = [peer for peer in group if peer != self.peer_id]
        if others or not contributing or (strangers and not formed):  # nobody fetches from a node that offered nothing
            return others, {}
        return self._missed_group(round_, MISSED_ALLREDUCE_GRACE if formed else MISSED_GROUP_GRACE)

    def _missed_group(self, round_: int, grace: float) -> tuple[list[str], dict[str, Fetched | None]]:
        """The group that averaged `round_` with us although our own matchmaking failed.

        hivemind's matchmaking can end one-sided: a leader counts us in while our request to it
        timed out (a loaded machine). The members then fetch our payload and take it into their
        mean; averaging alone would split our φ from theirs. So we ask a peer that fetched ours for
        its group and fetch the members' payloads: the same contributions, hence the same mean.
        Under butterfly the members push us the part we own instead, each naming the group.
        """
        started = time.monotonic()
        while True:  # a fetch of our payload (all-gather) or a push of our part (butterfly) tells us
            fetchers = sorted(p for p in self._exchange.served(round_, timeout=GROUP_POLL_SECONDS / 2)
                              if self.presence.known(p))
            if fetchers:
                break
            if claimed := self._streams.run(self._butterfly.claimed_group(round_, self.peer_id), timeout=5):
                others = [p for p in claimed if p != self.peer_id]
                if self._butterfly_for(round_, claimed) is None or self.presence.strangers_in(others):
                    logger.warning("round=%d ignored the butterfly group pushed to us: not all verified nodes",
                                   round_)
                    return [], {}
                logger.info("round=%d our matchmaking failed but %s pushed us their parts; joining that group",
                            round_, ", ".join(others))
                return others, {}
            waited = time.monotonic() - started
            if waited >= grace or (waited >= MISSED_GROUP_GRACE and not self._anyone_may_still_fetch(round_)):
                return [], {}
        fetched = self._exchange.fetch_all(fetchers[:1], round_, self.settings.round_timeout)
        first = fetched[fetchers[0]]
        if first is None or first.group is None or not {self.peer_id, fetchers[0]} <= set(first.group):
            return [], {}
        others = [p for p in first.group if p != self.peer_id]
        # The group a fetcher names is taken only if every member is a verified node of the run and
        # names the same group: one peer cannot point us at a group of its own making.
        if self.presence.strangers_in(others):
            logger.warning("round=%d ignored the group peer=%s named: not all verified nodes", round_, fetchers[0])
            return [], {}
        fetched.update(self._exchange.fetch_all([p for p in others if p not in fetched], round_,
                                                self.settings.round_timeout))
        if any(item is None or item.group != first.group for item in fetched.values()):
            logger.warning("round=%d ignored the group peer=%s named: its members do not all name it",
                           round_, fetchers[0])
            return [], {}
        logger.info("round=%d our matchmaking failed but %s averaged with us; joining that group",
                    round_, ", ".join(others))
        return others, fetched

    def _drawn_group_failed_too(self, round_: int) -> bool:
        """NoLoCo: whether the members of our drawn group are all still at `round_`, having neither
        averaged without us nor moved on. Seen under load: both nodes of a pair, ready together,
        each failed to find the other (hivemind's matchmaking declares leaders in the DHT, and a
        declaration can come too late to be seen). They fail at about the same time, so when
        each tries once more they meet."""
        if not self.settings.group_size:
            return False
        partners = [peer for peer in self.drawn_group(round_) if peer != self.peer_id]
        return bool(partners) and self.presence.round_state(round_, among=partners) == Outcome.TOGETHER

    def _anyone_may_still_fetch(self, round_: int) -> bool:
        """Whether a peer whose record decides (proofs.counted: every record before any proof) may
        still fetch our payload of `round_`: a forged record that copies an honest one never
        marks the round exchanged, and would hold us for the whole grace every round."""
        return any(record.may_still_fetch(round_) for record in self.presence.deciding_peers().values())

    def _form_group(self, round_: int, spare: bool = False) -> tuple[list[str], bool]:
        """Matchmake with the peers averaging `round_`: their peer ids, ourselves included, and
        whether a group had formed (False when matchmaking found none: then the list is just us)."""
        bits = round_bits(round_, self.peer_id, self.drawn_groups(round_) if self.settings.group_size else None,
                          spare)
        # Matchmaking starts once the group's members are ready (DiLoCo's barrier over the run,
        # NoLoCo's over its drawn group), so it needs a few windows at most; a node that missed its
        # group fails fast instead of holding up the next round's barrier for the whole round timeout.
        timeout = min(self.settings.round_timeout, 4 * self.settings.matchmaking_time + MATCHMAKING_SLACK)
        try:
            with self._averager_lock:
                bounded.wait(self._averager.set_group_bits(bits, wait=False), bounded.AVERAGER_CALL_TIMEOUT,
                             "averager's set_group_bits")
                control = bounded.call(lambda: self._averager.step(
                    gather={"round": round_}, timeout=timeout,
                    scheduled_time=get_dht_time() + self.settings.matchmaking_time, wait=False),
                    bounded.AVERAGER_CALL_TIMEOUT, "averager's step")
            # the step gives up finding a group after `timeout`; a group it found then all-reduces
            # the dummy within allreduce_timeout (the round timeout)
            gathered = bounded.wait(control, timeout + self.settings.round_timeout + MATCHMAKING_SLACK,
                                    "averager's matchmaking")
        except Exception as exc:  # hivemind surfaces timeouts and peer failures as assorted types
            logger.warning("round=%d no group formed (%s)", round_, type(exc).__name__)
            # the group formed and its all-reduce failed on our side only: its leader may still
            # complete it with us counted in, after its own wait for our part (sender_timeout)
            return [self.peer_id], formed_then_failed(exc)
        group = [self.peer_id]
        for peer, info in (gathered or {}).items():
            if str(peer) == self.peer_id:
                continue
            if not (isinstance(info, dict) and info.get("round") == round_):
                logger.warning("round=%d ignored peer=%s: malformed group metadata", round_, peer)
            elif self.presence.strangers_in([str(peer)]):  # hivemind's matchmaking admits anyone
                logger.warning("round=%d ignored peer=%s in our group: no verified record of this run", round_, peer)
            else:
                group.append(str(peer))
        return group, True

    def shutdown(self, graceful: bool = True) -> None:
        """`graceful`: let the averager unregister its handlers from p2pd; not when a helper died
        (p2pd may be gone, and the averager would print the failure as a traceback)."""
        if not self._averager.is_alive():  # hivemind logs a dead averager's shutdown as an exception
            return
        if graceful:
            self._averager.shutdown()
        else:
            self._averager.terminate()
            self._averager.join(AVERAGER_EXIT_SECONDS)

    @property
    def process(self) -> DecentralizedAverager:
        """The averager's helper process, for the watchdog."""
        return self._averager
