"""Presence: who is in the run and how far each node has got, kept fresh by a heartbeat.

Also the round barrier built on it, and the refusal of peers whose config differs from ours.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator

from diloco_node.errors import NodeError
from diloco_node.lru import LRUSet
from diloco_node.round import Outcome
from diloco_node.swarm import bounded, records
from diloco_node.swarm.isolation import Isolation
from diloco_node.trust import proofs
from diloco_node.trust.admission import Gate
from diloco_node.trust.records import MAX_VOUCHED, NodeRecord, canonical_digest

logger = logging.getLogger(__name__)

# What the heartbeat costs: each DHT read returns every node's signed record (~4.4 KB on the wire
# for two nodes) and each store first runs a lookup that reads them too (~7 KB). At one of each
# every 3 s that was 7.6 KB/s for an idle pair, more than an int4 payload per round at H = 300
# (benchmarks/background.py). So the heartbeat looks every HEARTBEAT_SECONDS but reads the records
# only when nothing else has read them meanwhile, and stores our record only when it has not gone
# out for REFRESH_SECONDS.
HEARTBEAT_SECONDS = 10.0
REFRESH_SECONDS = 10.0  # records.RECORD_TTL (25 s) survives one lost refresh
ISOLATED_HEARTBEAT_SECONDS = 1.0
TICK_SECONDS = 0.5  # how often the heartbeat thread checks whether a read or a refresh is due
WAITING_LOG_SECONDS = 30.0
REFUSALS_SHOWN = 4  # peers newly refused for their config, named one line each per read of the records
# Waits on the records (the barrier, peers at start-up) read them 0.3 s apart at first, backing off
# to 1 s: a peer that arrives at once is seen at once, and a long wait costs a read a second, not three.
FIRST_POLL_SECONDS = 0.3
MAX_POLL_SECONDS = 1.0
# How long the barrier waits for a newcomer (a peer that took a proven peer's state, trust/proofs.py)
# once the proven peers are ready, as a share of the round timeout: a joiner starts its first round
# a state download later than they did (seconds for a small model, more for a large one, whose
# runs set a longer round timeout); a forged identity that downloaded our state and never becomes
# ready lengthens one round by this much, once, and no other newcomer is waited for during the
# next PROOF_ROUNDS rounds unless it is proven (proofs.Proofs.newcomers: one grace for all fresh identities).
NEWCOMER_GRACE = 0.5
# How long a NoLoCo node waits for a drawn partner it has no proof for (neither counted nor endorsed
# by a counted peer, nor a newcomer: trust/proofs.py), as a share of the round timeout, once its
# trusted partners are ready: a forged record drawn into our group costs this much, not the round
# timeout; an honest partner we never met that is later than this misses the round with us.
STRANGER_GRACE = 0.1
# A joiner we served publishes its record only once our state is installed, a second or more after
# the serve, while our barrier of the round it joins may come sooner: that barrier waits this long
# (and at most the newcomer's grace) for the record, once per joiner (proofs.Proofs.newcomers). A
# blocking pair whose barrier went on without it averaged that round alone on both sides (φ split).
JOINER_RECORD_SECONDS = 10.0
# A request from a peer we do not know reads the records again at most this often: fresh peer ids
# cannot make us read the DHT (under its lock) once per request (docs/architecture.md §9)
UNKNOWN_PEER_READ_SECONDS = 2.0


def polls() -> Iterator[float]:
    """The pauses between two reads of a wait on the records."""
    poll = FIRST_POLL_SECONDS
    while True:
        yield poll
        poll = min(1.5 * poll, MAX_POLL_SECONDS)


def round_state(others: Collection[NodeRecord], round_: int, counted: Collection[str] | None = None,
                newcomers: Collection[str] = ()) -> Outcome:
    """Where `others` stand on `round_`: behind (most of the counted ones already exchanged it, so
    the run went on without us), alone (none is left), together (all the counted ones and the
    `newcomers` finished their inner phase of it) or waiting.

    `counted`: the peers whose records decide (proofs.counted; None: all). Any peer can publish
    records claiming a far-ahead round, which would make us drop our work and re-sync, or one that
    never becomes ready, which would hold the barrier for the round timeout: only proven peers
    decide and are waited for (and newcomers, once, see proofs.py). Unproven peers that are ready
    still take part in the round's matchmaking."""
    if moved_on(proofs.deciding(others, counted), round_):
        return Outcome.BEHIND
    if not others:
        return Outcome.ALONE
    waited = [r for r in others if counted is None or r.peer_id in counted or r.peer_id in newcomers]
    if all(r.ready_round >= round_ for r in waited):
        return Outcome.TOGETHER
    return Outcome.WAITING


def moved_on(others: Collection[NodeRecord], round_: int) -> bool:
    """Whether more than half of `others` have exchanged `round_`."""
    return 2 * sum(r.exchanged_round >= round_ for r in others) > len(others)


class IncompatibleRun(NodeError, RuntimeError):
    """The run already has nodes with another config; raised before we take part in anything."""


class Presence:
    def __init__(self, dht: DHT, peer_id: str, run_id: str, fingerprint: str, config: dict[str, Any],
                 isolation: Isolation, signed_by: RSASignatureValidator, gate: Gate, client: bool = False,
                 anchors: Collection[str] = ()):
        """`client`: we accept no inbound connection (reachability.py), and our record says so;
        `anchors`: the peer ids the operator named with `--peers` (proofs.py)."""
        self._dht, self.peer_id, self.run_id = dht, peer_id, run_id
        self.proofs, self.anchors = proofs.Proofs(peer_id), frozenset(anchors) - {peer_id}
        self.isolation = isolation  # fed by the heartbeat
        self._signer, self.gate = signed_by, gate
        self.on_revoked: Callable[[], None] | None = None  # the run owner revoked our own admission
        self.fingerprint, self.config = fingerprint, config
        self._dht_lock = threading.Lock()  # hivemind's DHT pipe is not safe to share between threads
        # announce (main thread) and mark_exchanged (also the exchange's thread) each rewrite our
        # record from the last one: one lock, so neither loses the other's field
        self._record_lock = threading.Lock()
        self._record = NodeRecord(peer_id, fingerprint, 0, -1, "", admission=gate.token, client=client)
        self._served_in: dict[str, int] = {}  # joiners we served: the round we were at (JOINER_RECORD_SECONDS)
        self._stats: dict[str, Any] = {}
        # monotonic times of our last store of the record, read of the records, store of our config
        self._published_at = self._read_at = self._config_published_at = -math.inf
        # peers refused for their config, and (peer, why) not admitted: each logged once. Records are
        # free, so both forget the least recent beyond MAX_TRACKED_PEERS (docs/architecture.md §9)
        self._refused = LRUSet()
        self._unadmitted = LRUSet()
        self._live: dict[str, NodeRecord] = {}
        self._departed: dict[str, NodeRecord] = {}  # compatible nodes that left recently
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="swarm-heartbeat", daemon=True)

    def check_compatible(self) -> None:
        """Refuse to go on if the run already uses another config (before we take part in anything):
        when no live node shares ours. One record with another config, which any peer can publish,
        does not keep us out of a run whose nodes share ours (it is logged and refused)."""
        found = [r for r in self._fetch().values() if r.peer_id != self.peer_id]
        others = [r for r in found if r.fingerprint != self.fingerprint]
        if others and len(others) == len(found):
            self._publish()  # so that the run's nodes see, and log, whom they refused
            # one short line of the options that differ, as the user types them (docs/architecture.md §4)
            theirs = others[0].fingerprint
            raise IncompatibleRun(f"refused: run '{self.run_id}' uses an incompatible config: "
                                  f"{self._differences([theirs])[theirs]} (peer …{others[0].peer_id[-8:]})")

    def enter(self, round_: int, digest: str, served: tuple[int, str]) -> None:
        """Announce ourselves as a member at `round_`, after any state download: a joiner that the
        others counted while it downloads would hold up their barrier for as long."""
        self.check_compatible()
        self.announce(round_, ready_round=round_ - 1, digest=digest, served=served)
        self._heartbeat.start()

    def announce(self, round_: int, ready_round: int, digest: str, served: tuple[int, str]) -> None:
        """`digest`: φ's at the start of `round_`; `served`: the (round, digest) of the state we serve."""
        with self._record_lock:
            self._record = dataclasses.replace(self._record, round=round_, ready_round=ready_round, digest=digest,
                                               served_round=served[0], served_digest=served[1], stats=self._stats)
            self._publish()

    def mark_exchanged(self, round_: int) -> None:
        """Our exchange of `round_` is over: a node still waiting to exchange it is behind. It goes
        out with our next store (the next announcement or refresh, within REFRESH_SECONDS), not one
        of its own: each store costs a read of every record too (see HEARTBEAT_SECONDS)."""
        with self._record_lock:  # never backwards: an overlapped exchange may report an older round late
            self._record = dataclasses.replace(self._record,
                                               exchanged_round=max(round_, self._record.exchanged_round))

    def vouch(self, peer: str, round_: int | None = None) -> None:
        """`peer` took our state: the barrier waits for it in its first round (proofs.py), and it
        may fetch the payloads of rounds we had in flight from our group, which serves them only to
        members and to those a member vouches for. `round_`: the round of the state it took, its
        first (our record's by default)."""
        with self._record_lock:
            self._served_in.pop(peer, None)
            self._served_in[peer] = self._record.round if round_ is None else round_
            while len(self._served_in) > MAX_VOUCHED:
                del self._served_in[next(iter(self._served_in))]
            if self._record.vouched[-1:] == (peer,):
                return  # said already: a peer asking again costs us no store
            vouched = [p for p in self._record.vouched if p != peer][-(MAX_VOUCHED - 1):] + [peer]
            self._record = dataclasses.replace(self._record, vouched=tuple(vouched))
            self._publish()

    def vouched(self, peer: str) -> bool:
        """Whether `peer` took our state (see `vouch`; the same last MAX_VOUCHED peers our record
        lists), known here before the joiner's first record reaches us or ours reaches the DHT."""
        with self._record_lock:
            return peer in self._served_in

    def prove(self, round_: int, peers: Collection[str]) -> None:
        """`peers`' checked contributions went into the mean we applied in `round_` (proofs.py); our
        record lists our proven peers from the next store on (a joiner anchored on us counts them)."""
        if self.proofs.prove(round_, peers):
            with self._record_lock:
                self._record = dataclasses.replace(self._record, proven=tuple(sorted(self.proofs.proven())))

    def deciding_peers(self, refresh: bool = False) -> dict[str, NodeRecord]:
        """The live records that decide: those of counted peers (all before any proof), ourselves excluded."""
        found = self.compatible_peers(refresh=refresh)
        who = proofs.counted(self.proofs.proven(), self.anchors, found)
        return {p: r for p, r in found.items() if p != self.peer_id and (who is None or p in who)}

    def state_peers(self) -> dict[str, NodeRecord]:
        """The live records that choose and serve the state we download (proofs.state_sources:
        the deciding ones, or in a fresh run our anchors), read now, ourselves excluded."""
        found = self.compatible_peers(refresh=True)
        who = proofs.state_sources(self.proofs.proven(), self.anchors, found)
        return {p: r for p, r in found.items() if p != self.peer_id and (who is None or p in who)}

    def unanchored(self) -> bool:
        """Whether the records choosing our state are every record (proofs.state_sources: no proof
        of ours, no `--peers` naming a node of the run) while other nodes are about."""
        found = self.compatible_peers(refresh=True)
        return any(p != self.peer_id for p in found) and \
            proofs.state_sources(self.proofs.proven(), self.anchors, found) is None

    def known(self, peer: str, refresh: bool = False) -> NodeRecord | None:
        """`peer`'s record when it is a verified, admitted node of this run with our config (live,
        or left within RECORD_TTL)."""
        if refresh and peer not in self._live and peer not in self._departed:
            self._fetch()
        return self._live.get(peer) or self._departed.get(peer)

    def recent_peers(self) -> dict[str, NodeRecord]:
        """compatible_peers, the records read again unless read within UNKNOWN_PEER_READ_SECONDS
        (what a stream handler asks about a peer that may be unknown: fresh ids cost no DHT reads)."""
        if time.monotonic() - self._read_at >= UNKNOWN_PEER_READ_SECONDS:
            self._fetch()
        return dict(self._live)

    def _publish(self) -> None:
        try:
            self._store_record()
        except bounded.HelperTimeout as exc:  # the heartbeat publishes again at its next tick
            if not isinstance(exc, bounded.HelperGone):  # the node is stopping and said why
                logger.warning("our record was not published: %s", exc)

    def _store_record(self) -> None:
        with self._dht_lock:
            if time.monotonic() - self._config_published_at >= records.CONFIG_TTL / 2:
                # first, so that a node refusing our record finds what differs
                records.publish_config(self._dht, self.run_id, self.config)
                self._config_published_at = time.monotonic()
            records.publish(self._dht, self.run_id, self._record, self._signer)
            self._published_at = time.monotonic()

    def _differences(self, fingerprints: Collection[str]) -> dict[str, str]:
        """What differs between our config and each one `fingerprints` name, as far as it is
        published: one DHT read for all of them (a read that times out finds none published)."""
        try:
            with self._dht_lock:
                published = records.fetch_configs(self._dht, self.run_id, fingerprints)
        except bounded.HelperGone:
            raise
        except bounded.HelperTimeout:
            published = dict.fromkeys(fingerprints)
        shown = records.shown_value
        return {fingerprint: (records.config_difference(self.config, theirs) if theirs is not None else
                              f"fingerprint={shown(fingerprint)} (ours: {shown(self.fingerprint)}); "
                              "its config is not published")
                for fingerprint, theirs in published.items()}

    def publish_stats(self, **stats: Any) -> None:
        """Stats for the swarm table (see trust/records.py's NodeStats); they go out with the next announcement."""
        self._stats = {**self._stats, **stats}

    def compatible_peers(self, refresh: bool = False) -> dict[str, NodeRecord]:
        """Live nodes of this run with our config, ourselves included (as of the last heartbeat)."""
        if refresh:
            self._fetch()
        return dict(self._live)

    def may_still_fetch(self, peer: str, round_: int) -> bool:
        """Whether `peer`, a live node of the run, may still fetch our payload of `round_`."""
        record = self.compatible_peers().get(peer)
        return record is not None and record.may_still_fetch(round_)

    def present(self) -> int:
        """How many nodes --min-peers sees (ourselves included): see `wait_for_peers`."""
        found = self.compatible_peers(refresh=True)
        who = proofs.counted(self.proofs.proven(), self.anchors, found)
        return len(found) if who is None else 1 + len(who.intersection(found) - {self.peer_id})

    def departed_after(self, round_: int) -> list[str]:
        """Compatible nodes that left (within RECORD_TTL) after exchanging `round_` (as of the last
        heartbeat): they took part in that round although they are gone now."""
        return [peer for peer, record in self._departed.items()
                if record.exchanged_round >= round_ and peer not in self._live]

    def wait_for_peers(self, count: int, stop: threading.Event) -> bool:
        """Block until `count` compatible nodes (ourselves included) are in the run; False if stopped.
        Once any proof exists (ours, or a joiner's anchors', proofs.counted) only the counted peers
        are counted: forged records cannot start us early; before, every record (§9, --min-peers)."""
        started = time.monotonic()
        pauses = polls()
        while (present := self.present()) < count:
            if stop.wait(next(pauses)):
                return False
            if time.monotonic() - started > WAITING_LOG_SECONDS:
                logger.info("still waiting for nodes present=%d wanted=%d", present, count)
                started = time.monotonic()
        return True

    def wait_for_round(self, round_: int, timeout: float, stop: threading.Event,
                       among: Collection[str] | None = None) -> Outcome:
        """Wait until every live compatible peer (of `among`, when given) has finished its inner
        phase of `round_`.

        Only proven peers are waited for up to `timeout` (of NoLoCo's drawn group: the trusted
        ones, proofs.trusted); a newcomer (proofs.py) for at most NEWCOMER_GRACE of it once they
        are ready, as anyone can take our state under a fresh identity and never become ready; any
        other drawn partner for STRANGER_GRACE of it, as anyone can publish a record that is drawn.

        Returns TOGETHER (everyone is ready), TIMEOUT (go on with those that are), ALONE
        (nobody else is in the run), BEHIND (others already finished this round) or STOPPED
        (the node was asked to stop while waiting).
        """
        started = time.monotonic()
        deadline = started + timeout
        pauses = polls()
        counted_ready_at: float | None = None  # when every counted peer was ready, the others aside
        while True:
            others = self._others(among)
            counted, newcomers, strangers = self._waited_for(others, round_, among)
            # once the counted peers are ready, each of the others is waited for its grace only
            late = 0.0 if counted_ready_at is None else time.monotonic() - counted_ready_at
            pending = {*(newcomers if late <= NEWCOMER_GRACE * timeout else ()),
                       *(strangers if late <= STRANGER_GRACE * timeout else ())}
            state = round_state(others.values(), round_, counted, pending)
            if state == Outcome.TOGETHER and (unseen := self._unseen_joiners(others, round_, among)):
                if time.monotonic() - started < min(JOINER_RECORD_SECONDS, NEWCOMER_GRACE * timeout):
                    if stop.wait(next(pauses)):
                        return Outcome.STOPPED
                    continue
                logger.info("round=%d not waiting longer for newcomer %s: no record of it at this round",
                            round_, ", ".join(sorted(unseen)))
                self.proofs.late_newcomers(round_, unseen)
            if state != Outcome.WAITING:
                for word, peers in (("newcomer", newcomers - pending), ("unproven partner", strangers - pending)):
                    if unready := sorted(p for p in peers if others[p].ready_round < round_):
                        logger.info("round=%d not waiting longer for %s %s", round_, word, ", ".join(unready))
                        if word == "newcomer":  # no other newcomer is waited for a while (proofs.py)
                            self.proofs.late_newcomers(round_, unready)
                return state
            if counted_ready_at is None and (newcomers or strangers) and \
                    round_state(others.values(), round_, counted) == Outcome.TOGETHER:
                counted_ready_at = time.monotonic()
            if time.monotonic() > deadline:
                waiting = sorted(p for p, r in others.items() if r.ready_round < round_
                                 and (counted is None or p in counted or p in pending))
                logger.warning("round=%d barrier timed out; not waiting for %s", round_, ", ".join(waiting))
                return Outcome.TIMEOUT
            if stop.wait(next(pauses)):
                return Outcome.STOPPED

    def _unseen_joiners(self, others: dict[str, NodeRecord], round_: int, among: Collection[str] | None) -> set[str]:
        """Joiners we served while at `round_` whose record does not show that round yet (they are
        still installing our state), each waited for as a newcomer: once, and not while a late
        newcomer is unproven (proofs.Proofs.newcomers). NoLoCo's drawn groups (`among`) are drawn
        from records: a joiner without one is in none."""
        if among is not None:
            return set()
        with self._record_lock:
            served = [p for p, at in self._served_in.items() if at == round_]
        unseen = [p for p in served if p not in others or others[p].round < round_]
        return self.proofs.newcomers(unseen, round_) if unseen else set()

    def round_state(self, round_: int, among: Collection[str] | None = None) -> Outcome:
        """Where the others (of `among`, when given) stand on `round_` right now; see `round_state`."""
        others = self._others(among)
        counted, newcomers, strangers = self._waited_for(others, round_, among)
        return round_state(others.values(), round_, counted, newcomers | strangers)

    def strangers_only(self, round_: int, newcomers: bool = True) -> bool:
        """Whether none of the other live records is of a peer worth a matchmaking window in
        `round_`: counted (before any proof: an anchor that is a node of the run, proofs.known) or,
        with `newcomers`, a newcomer in its first round. A record that copies an honest one is
        ready whenever it is and never matchmakes: with only such records about, matchmakings are
        spaced out (proofs.Proofs.may_matchmake_strangers)."""
        found = self.compatible_peers()
        expected = proofs.known(self.proofs.proven(), self.anchors, found) | \
            (self.proofs.granted(round_) if newcomers else set())
        return not any(p in expected for p in found if p != self.peer_id)

    def drawn_partners(self, round_: int, among: Collection[str]) -> list[str]:
        """Those of NoLoCo's drawn partners `among` worth matchmaking with once the barrier is
        passed: the trusted ones (proofs.trusted; all before any proof), and the others that are
        ready for `round_`. A forged record drawn with us is thus never matchmade for. A partner
        whose record already trains a later round is not either: it averaged `round_` without us
        (NoLoCo marks no exchanged round), and matchmaking for it would only wait out its timeout,
        twice (seen when two nodes' views of the records differed and so did their draws)."""
        found = self.compatible_peers()
        trusted = proofs.trusted(self.proofs.proven(), self.anchors, found)
        return [p for p in among if not (p in found and found[p].round > round_)
                and (trusted is None or p in trusted or (p in found and found[p].ready_round >= round_))]

    def spare_partners(self, round_: int, groups: list[list[str]]) -> list[str]:
        """NoLoCo: whom we matchmake with once more, under the round's spare key, when every drawn
        partner of ours was dropped (`drawn_partners` kept none): the peers we trust
        (proofs.trusted) that are at `round_` and, as we see the run, were drawn only with peers
        that are neither trusted by us nor ready, so they will have dropped theirs too. Forged
        records dilute the draws (an honest partner with probability (h − 1)/(h + k − 1)); here
        the honest nodes they left partnerless find each other (docs/architecture.md §9). Empty
        before any proof (a drawn group then counts whole, nobody is dropped) and when no such
        peer exists. A trusted odd one out of the draw (a group of one) is one too: it looks for
        spare partners itself (`odd_spare_partners`)."""
        found = self.compatible_peers()
        trusted = proofs.trusted(self.proofs.proven(), self.anchors, found)
        if trusted is None:
            return []

        def kept(peer: str) -> bool:  # what drawn_partners keeps, as far as we can see it
            record = found.get(peer)
            return record is not None and record.round <= round_ and \
                (peer in trusted or record.ready_round >= round_)

        spare = []
        for group in groups:
            if self.peer_id in group:
                continue
            for peer in group:
                record = found.get(peer)
                if peer in trusted and record is not None and record.round == round_ and \
                        not any(kept(other) for other in group if other != peer):
                    spare.append(peer)
        return spare

    def odd_spare_partners(self, round_: int, groups: list[list[str]], timeout: float,
                           stop: threading.Event) -> list[str]:
        """NoLoCo, when we are the odd one out of the draw: the trusted peers still left
        partnerless (`spare_partners`) once their drawn partners have had STRANGER_GRACE of the
        round timeout to get ready (the grace those peers give them). With an odd number of
        records an honest node is the odd one out about one round in N, and a trusted peer drawn
        only with forged records would otherwise look for it under the spare key in vain. Empty
        at once when nobody is partnerless (an honest run whose nodes trust each other pays
        nothing), and when `stop` is set."""
        until = time.monotonic() + STRANGER_GRACE * timeout
        pauses = polls()
        while (spare := self.spare_partners(round_, groups)) and time.monotonic() < until:
            if stop.wait(next(pauses)):
                return []
            self.recent_peers()  # the partners' records, fresh (at most one read per 2 s)
        return spare

    def _waited_for(self, others: dict[str, NodeRecord], round_: int,
                    among: Collection[str] | None) -> tuple[set[str] | None, set[str], set[str]]:
        """Whose records decide and are waited for up to the timeout (proofs.counted; NoLoCo's drawn
        group `among`: those of it proofs.trusted); the newcomers waited for in `round_` for
        NEWCOMER_GRACE: unproven peers that took the state of a counted peer or ours (its record
        vouches for them) and are at `round_`, each in one round only (proofs.Proofs.newcomers);
        and the strangers, NoLoCo's other drawn partners, waited for STRANGER_GRACE."""
        found = self.compatible_peers()
        vouchers = proofs.counted(self.proofs.proven(), self.anchors, found)
        # before any proof, those our anchors or we served: every record is waited for then, but a
        # newcomer's first round is still one worth matchmaking for (strangers_only)
        vouched = proofs.vouched_by(found, (vouchers or proofs.known((), self.anchors, found)) | {self.peer_id})
        candidates = [p for p in vouched if p in others and (vouchers is None or p not in vouchers)
                      and (others[p].round == round_ or others[p].ready_round >= round_)]
        newcomers = self.proofs.newcomers(candidates, round_)
        if vouchers is None:  # before any proof every record counts, a drawn group whole (proofs.py)
            return (None if among is None else set(among)), set(), set()
        counted = vouchers if among is None else \
            set(among) & (vouchers | proofs.endorsed(vouchers, found))  # proofs.trusted
        newcomers -= counted
        strangers = set() if among is None else {p for p in others if p not in counted and p not in newcomers}
        return counted, newcomers, strangers

    def _others(self, among: Collection[str] | None) -> dict[str, NodeRecord]:
        return {p: r for p, r in self._fetch().items()
                if p != self.peer_id and r.fingerprint == self.fingerprint and (among is None or p in among)}

    def all_past(self, round_: int) -> bool:
        """Whether every other live node that decides (proofs.py) has already exchanged `round_`
        (so we are behind them)."""
        others = self.deciding_peers(refresh=True).values()
        return bool(others) and all(r.exchanged_round >= round_ for r in others)

    def isolated(self) -> bool:
        """Cut off from every peer (swarm/isolation.py), as of our last look at the run's records
        (the barrier's or the heartbeat's) rather than as of the last heartbeat's verdict."""
        if self.isolation.since is not None:
            return True
        return self.isolation.cut_off([p for p in self.compatible_peers() if p != self.peer_id])

    def ahead_of(self, round_: int) -> bool:
        """Whether most other live nodes of the run that decide (proofs.py) have already exchanged
        `round_` (we are behind)."""
        return moved_on(list(self.deciding_peers(refresh=True).values()), round_)

    def served_diverged(self, among: Collection[str]) -> bool:
        """Whether the state we serve, as our record last announced it, differs from the one most
        of `among` serve settled up to the same round (overlapped modes; see `diverged`)."""
        with self._record_lock:
            ours = self._record
        return self.diverged(ours.served_round, ours.served_digest, among, served=True)

    def diverged(self, round_: int, digest: str, among: Collection[str], served: bool = False) -> bool:
        """Whether our φ differs from the canonical φ for the start of `round_` of `among`, the
        group we averaged that round with (ourselves included); `served`: whether the state we
        serve, settled up to `round_`, differs from the one the group serves (overlapped modes).

        φ can split when an exchange fails on one side only (one node got the other's payload,
        the other did not); the nodes holding a non-canonical φ re-sync. Only the group's records
        count: records of peers that averaged nothing with us, which anyone can publish in any
        number, cannot outvote the group and make us drop our φ.
        """
        group = [r for p, r in self.compatible_peers().items() if p in among]
        canonical = canonical_digest(group, round_, served)
        return canonical is not None and digest != canonical

    def leave(self) -> None:
        if not self._heartbeat.is_alive():
            # We never entered (e.g. refused): our record stays until it expires, so that the
            # nodes of the run get to see, and log, whom they refused.
            return
        self._stop.set()
        try:
            with self._dht_lock:
                records.withdraw(self._dht, self.run_id, self._record, self._signer)
        except Exception as exc:  # leaving must never fail; the record expires on its own anyway
            logger.debug("withdraw failed: %r", exc)

    def _fetch(self) -> dict[str, NodeRecord]:
        try:
            with self._dht_lock:
                found, departed = records.fetch(self._dht, self.run_id)
                self._read_at = time.monotonic()
        except bounded.HelperTimeout as exc:  # what we last read stands; every wait reads again
            if not isinstance(exc, bounded.HelperGone):
                logger.warning("the run's records were not read: %s", exc)
            return dict(self._live)
        found, departed = self._admitted(found), self._admitted(departed)
        self._live = {p: r for p, r in found.items() if r.fingerprint == self.fingerprint}
        self._departed = {p: r for p, r in departed.items() if r.fingerprint == self.fingerprint}
        self._live[self.peer_id] = self._record  # our latest, not the DHT's copy of an older one
        self._log_refused({p: r.fingerprint for p, r in found.items()
                           if r.fingerprint != self.fingerprint and p not in self._refused})
        return found

    def _log_refused(self, fingerprints: dict[str, str]) -> None:
        """Say once of each peer newly refused for its config what differs: a line for each of the
        first REFUSALS_SHOWN, one count for the rest (fresh ids are free, a read of their configs is not)."""
        if not fingerprints:
            return
        for peer in fingerprints:
            self._refused.add(peer)
        shown = list(fingerprints.items())[:REFUSALS_SHOWN]
        differences = self._differences({fingerprint for _, fingerprint in shown})
        for peer, fingerprint in shown:
            logger.warning("refused peer %s: incompatible config (%s)", peer, differences[fingerprint])
        if len(fingerprints) > len(shown):
            logger.warning("refused %d more peers: incompatible configs", len(fingerprints) - len(shown))

    def _admitted(self, found: dict[str, NodeRecord]) -> dict[str, NodeRecord]:
        """The records of admitted peers (all of them in an open run); the others are logged once."""
        admitted = {}
        for peer, record in found.items():
            why = self.gate.refusal(peer, record.admission)
            if why is None:
                admitted[peer] = record
            elif peer != self.peer_id and (peer, why) not in self._unadmitted:
                self._unadmitted.add((peer, why))
                logger.warning("ignored peer %s: not admitted (%s)", peer, why)
        return admitted

    def read_revocations(self) -> None:
        """Read the run's revocations now (the heartbeat reads them too): a joiner reads them before
        it chooses whom to download the run's state from."""
        self._check_revocations()

    def _check_revocations(self) -> None:
        if not self.gate.permissioned:
            return
        with self._dht_lock:
            tokens = records.fetch_revocations(self._dht, self.run_id)
        for peer in self.gate.add_revocations(tokens):
            logger.warning("the run owner revoked the admission of peer %s", peer)
            if peer == self.peer_id and self.on_revoked:
                self.on_revoked()

    def _heartbeat_loop(self) -> None:
        looked_at = time.monotonic()
        while not self._stop.wait(TICK_SECONDS):
            # Faster while isolated: a peer that answers a dial is seen (and sees us) a second later.
            every = ISOLATED_HEARTBEAT_SECONDS if self.isolation.since else HEARTBEAT_SECONDS
            try:
                if time.monotonic() - self._published_at >= min(every, REFRESH_SECONDS):
                    self._publish()
                if time.monotonic() - looked_at >= every:
                    looked_at = time.monotonic()
                    self._look(every)
            except bounded.HelperGone:  # the node is stopping and said why
                return
            except Exception as exc:  # a missed heartbeat is retried; the loop must outlive it
                logger.warning("heartbeat failed: %r", exc)

    def _look(self, every: float) -> None:
        """Revocations, and what the run's records tell the isolation watch. The records are read
        again only when nobody else read them within `every` s (the barrier reads them often);
        revocations only the heartbeat reads."""
        self._check_revocations()
        if time.monotonic() - self._read_at >= every:
            self._fetch()
        with self._dht_lock:
            self.isolation.observe([p for p in self._live if p != self.peer_id], list(self._departed))
