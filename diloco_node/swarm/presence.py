"""Presence: who is in the run and how far each node has got, kept fresh by a heartbeat.

Also the round barrier built on it, and the refusal of peers whose config differs from ours. Whose
records decide, whom the barrier waits for and whom we matchmake with is trust/'s (trust/view.py's
RunView, over our proofs): presence reads the records, asks, and waits, logs and acts.
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
from diloco_node.trust.records import MAX_VOUCHED, NodeRecord
from diloco_node.trust.view import RunView, round_state, strangers_in

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
# The run's configs value is read to say what differs at most this often: each read pulls the
# whole value under our DHT lock, and fresh incompatible ids (free) could ask for one every look.
CONFIG_READ_SECONDS = 30.0
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


class IncompatibleRun(NodeError, RuntimeError):
    """The run already has nodes with another config; raised before we take part in anything."""


class Presence:
    def __init__(self, dht: DHT, peer_id: str, run_id: str, fingerprint: str, config: dict[str, Any],
                 isolation: Isolation, signed_by: RSASignatureValidator, gate: Gate, client: bool = False,
                 anchors: Collection[str] = ()):
        """`client`: we accept no inbound connection (reachability.py), and our record says so;
        `anchors`: the peer ids the operator named with `--peers` (trust/proofs.py)."""
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
        self._holding: int | None = None  # the round whose ready announce held back for such a joiner (_release_ready)
        # (round, digest, served) of a round we began training while the last one's ready was held
        self._deferred: tuple[int, str, tuple[int, str]] | None = None
        self._held_at = -math.inf  # monotonic time the hold began
        self._stats: dict[str, Any] = {}
        # monotonic times of our last store of the record, read of the records, store of our config
        self._published_at = self._read_at = self._config_published_at = -math.inf
        self._configs_read_at = -math.inf  # monotonic time of our last read of the configs value (_log_refused)
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
        self.announce(round_, ready=False, digest=digest, served=served)
        self._heartbeat.start()

    def announce(self, round_: int, ready: bool, digest: str, served: tuple[int, str]) -> None:
        """We train `round_` or (`ready`) its inner phase is over; `digest`: φ's at the start of `round_`;
        `served`: the (round, digest) of the state we serve. Our record's `ready_round` is the last
        round whose inner phase we finished, and only that: a joiner entering at round r, or a node
        that re-synced to it, trained no r − 1, and saying it was ready for r − 1 had peers
        matchmake for it there in vain and spend its newcomer grace (trust/view.py, round_state).
        Ready while a joiner we served at `round_` has no record of it yet, we say so only once
        the barrier has seen it (_release_ready)."""
        hold = ready and bool(self._unseen_joiners(self._others(None, read=False), round_, None))
        with self._record_lock:
            held = self._holding if self._holding is not None and self._holding < round_ else None
            if not ready and held is not None:
                # Overlapped modes train the next round while the held one's barrier runs. A record at
                # `round_` never ready for the held round reads as one that skipped it (trust/view.py,
                # round_state), and the run would go on without us: the release publishes this one.
                self._deferred = (round_, digest, served)
                return
            # a later round's ready supersedes a hold: the held round's inner phase is over too
            finished = self._record.ready_round if held is None else max(self._record.ready_round, held)
            self._holding, self._deferred = (round_ if hold else None), None
            if hold:
                self._held_at = time.monotonic()
            ready_round = round_ if ready and not hold else min(finished, round_ - 1)
            self._announce(round_, ready_round, digest, served)

    def _announce(self, round_: int, ready_round: int, digest: str, served: tuple[int, str]) -> None:
        """Our record at `round_` (the caller holds _record_lock)."""
        self._record = dataclasses.replace(self._record, round=round_, ready_round=ready_round, digest=digest,
                                           served_round=served[0], served_digest=served[1], stats=self._stats)
        self._publish()

    def _release_stale_hold(self) -> None:
        """The heartbeat's bound on a hold: a held round whose barrier never runs (a re-sync, NoLoCo's
        held or odd rounds) would keep our record at it, and a deferred round unannounced, until
        our next ready; no barrier holds for a joiner longer than JOINER_RECORD_SECONDS."""
        with self._record_lock:
            held = self._holding
            stale = held is not None and time.monotonic() - self._held_at >= JOINER_RECORD_SECONDS
        if stale and held is not None:
            self._release_ready(held)

    def _release_ready(self, round_: int) -> None:
        """Say that we are ready for `round_` after all, if announce held it back. Why it holds: the
        node that served a joiner waits for the joiner's record (JOINER_RECORD_SECONDS), the run's
        other nodes do not know of the joiner yet; were we ready meanwhile, they would matchmake
        without us, the joiner would find their group, and the round would split (seen in CI: a
        late joiner's first round averaged with a third node, its server alone). Held, we keep
        their barrier (we are a counted peer) until the joiner is in view for all."""
        with self._record_lock:
            if self._holding != round_ or self._stop.is_set():  # a node that left publishes no record
                return
            self._holding = None
            if self._deferred is not None:  # the round we train now, its held predecessor ready
                (training, digest, served), self._deferred = self._deferred, None
                self._announce(training, round_, digest, served)
            elif self._record.round == round_ and self._record.ready_round < round_:
                self._record = dataclasses.replace(self._record, ready_round=round_)
                self._publish()

    def mark_exchanged(self, round_: int) -> None:
        """Our exchange of `round_` is over: a node still waiting to exchange it is behind. It goes
        out with our next store (the next announcement or refresh, within REFRESH_SECONDS), not one
        of its own: each store costs a read of every record too (see HEARTBEAT_SECONDS)."""
        with self._record_lock:  # never backwards: an overlapped exchange may report an older round late
            self._record = dataclasses.replace(self._record,
                                               exchanged_round=max(round_, self._record.exchanged_round))

    def vouch(self, peer: str, round_: int | None = None) -> None:
        """`peer` took our state: the barrier waits for it in its first round (trust/proofs.py), and it
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
        lists), known here before the joiner's first record reaches us or ours reaches the DHT.
        Read without the record's lock, which a store to the DHT holds for seconds: the streams'
        loop asks it for every stream it admits (facade._trusted), and one `in` on a dict is atomic."""
        return peer in self._served_in

    def prove(self, round_: int, peers: Collection[str]) -> None:
        """`peers`' checked contributions went into the mean we applied in `round_` (trust/proofs.py); our
        record lists our proven peers from the next store on (a joiner anchored on us counts them)."""
        if self.proofs.prove(round_, peers):
            with self._record_lock:
                self._record = dataclasses.replace(self._record, proven=tuple(sorted(self.proofs.proven())))

    def deciding_peers(self, refresh: bool = False) -> dict[str, NodeRecord]:
        """The live records that decide (trust/view.py: RunView.deciding), ourselves excluded."""
        return self.view(refresh).deciding()

    def state_peers(self) -> dict[str, NodeRecord]:
        """The live records that choose and serve the state we download (RunView.state_sources),
        read now, ourselves excluded."""
        return self.view(refresh=True).state_sources()

    def unanchored(self) -> bool:
        """Whether the records choosing our state are every record while other nodes are about
        (RunView.unanchored), read now."""
        return self.view(refresh=True).unanchored()

    def view(self, refresh: bool = False) -> RunView:
        """The run as we believe it (trust/view.py): the live records of our config (read now with
        `refresh`, else as of the last read) with our proofs and anchors."""
        found = self.compatible_peers(refresh=refresh)
        return RunView(self.peer_id, self.proofs.proven(), self.anchors, found)

    def known(self, peer: str, refresh: bool = False) -> NodeRecord | None:
        """`peer`'s record when it is a verified, admitted node of this run with our config (live,
        or left within RECORD_TTL)."""
        if refresh and peer not in self._live and peer not in self._departed:
            self._fetch()
        return self._live.get(peer) or self._departed.get(peer)

    def strangers_in(self, group: Collection[str]) -> list[str]:
        """trust/view.strangers_in over our records, read once more first when a member is missing
        (it may have joined since our last read): one DHT read at most, however many ids `group` names."""
        if any(self.known(peer) is None for peer in group if peer != self.peer_id):
            self._fetch()
        return strangers_in(group, self.peer_id, lambda peer: self.known(peer) is not None)

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
        return self.view(refresh=True).present()

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
        ones, proofs.trusted); a newcomer (trust/proofs.py) for at most NEWCOMER_GRACE of it once they
        are ready, as anyone can take our state under a fresh identity and never become ready; any
        other drawn partner for STRANGER_GRACE of it, as anyone can publish a record that is drawn.

        Returns TOGETHER (everyone is ready), TIMEOUT (go on with those that are), ALONE
        (nobody else is in the run), BEHIND (others already finished this round) or STOPPED
        (the node was asked to stop while waiting).
        """
        try:
            return self._wait_for_round(round_, timeout, stop, among)
        finally:
            self._release_ready(round_)  # whatever ended the wait: a held ready is never left behind

    def _wait_for_round(self, round_: int, timeout: float, stop: threading.Event,
                        among: Collection[str] | None) -> Outcome:
        started = time.monotonic()
        deadline = started + timeout
        joiner_wait = min(JOINER_RECORD_SECONDS, NEWCOMER_GRACE * timeout)
        pauses = polls()
        counted_ready_at: float | None = None  # when every counted peer was ready, the others aside
        while True:
            others = self._others(among)
            if self._holding == round_ and (among is not None or time.monotonic() - started >= joiner_wait
                                            or not self._unseen_joiners(others, round_, among)):
                self._release_ready(round_)  # the joiner is in view (or given up on): ready, for everyone
            counted, newcomers, strangers = self.view().waited_for(others, round_, among, self.proofs)
            # once the counted peers are ready, each of the others is waited for its grace only
            late = 0.0 if counted_ready_at is None else time.monotonic() - counted_ready_at
            pending = {*(newcomers if late <= NEWCOMER_GRACE * timeout else ()),
                       *(strangers if late <= STRANGER_GRACE * timeout else ())}
            state = round_state(others.values(), round_, counted, pending)
            # ALONE too: a node alone in its run that just served its first joiner sees no record
            # yet, and going on alone would leave the joiner behind at once (re-sync, alone again)
            if state in (Outcome.TOGETHER, Outcome.ALONE) and (unseen := self._unseen_joiners(others, round_, among)):
                if time.monotonic() - started < joiner_wait:
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
                        if word == "newcomer":  # no other newcomer is waited for a while (trust/proofs.py)
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
        """Where the others (of `among`, when given) stand on `round_` right now; see trust/view.py's `round_state`."""
        others = self._others(among)
        counted, newcomers, strangers = self.view().waited_for(others, round_, among, self.proofs)
        return round_state(others.values(), round_, counted, newcomers | strangers)

    def strangers_only(self, round_: int, newcomers: bool = True) -> bool:
        """Whether none of the other live records is of a peer worth a matchmaking window in
        `round_` (RunView.strangers_only), with `newcomers`, the newcomers granted their first
        round, counting as worth one."""
        return self.view().strangers_only(self.proofs.granted(round_) if newcomers else set())

    def drawn_partners(self, round_: int, among: Collection[str]) -> list[str]:
        """Those of NoLoCo's drawn partners `among` worth matchmaking with once the barrier is
        passed (RunView.drawn_partners)."""
        return self.view().drawn_partners(round_, among)

    def spare_partners(self, round_: int, groups: list[list[str]]) -> list[str]:
        """NoLoCo: whom we matchmake with once more, under the round's spare key, when every drawn
        partner of ours was dropped (RunView.spare_partners)."""
        return self.view().spare_partners(round_, groups)

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

    def _others(self, among: Collection[str] | None, read: bool = True) -> dict[str, NodeRecord]:
        """The other live compatible nodes (of `among`), read now, or as of our last read (no DHT read)."""
        found = self._fetch() if read else self._live
        return {p: r for p, r in found.items()
                if p != self.peer_id and r.fingerprint == self.fingerprint and (among is None or p in among)}

    def all_past(self, round_: int) -> bool:
        """Whether every other live node that decides has already exchanged `round_` (RunView.all_past), read now."""
        return self.view(refresh=True).all_past(round_)

    def isolated(self) -> bool:
        """Cut off from every peer (swarm/isolation.py), as of our last look at the run's records
        (the barrier's or the heartbeat's) rather than as of the last heartbeat's verdict."""
        if self.isolation.since is not None:
            return True
        return self.isolation.cut_off([p for p in self.compatible_peers() if p != self.peer_id])

    def ahead_of(self, round_: int) -> bool:
        """Whether most other live nodes that decide have already exchanged `round_` (RunView.ahead_of), read now."""
        return self.view(refresh=True).ahead_of(round_)

    def past_inner_phase(self, round_: int) -> bool:
        """Whether most other live nodes that decide have ended their inner phase of `round_`
        (RunView.past_inner_phase), read now."""
        return self.view(refresh=True).past_inner_phase(round_)

    def served_diverged(self, among: Collection[str]) -> bool:
        """Whether the state we serve, as our record last announced it, differs from the one most
        of `among` serve settled up to the same round (overlapped modes; see `diverged`)."""
        with self._record_lock:
            ours = self._record
        return self.diverged(ours.served_round, ours.served_digest, among, served=True)

    def diverged(self, round_: int, digest: str, among: Collection[str], served: bool = False) -> bool:
        """Whether our φ (`served`: the state we serve) differs from the canonical one of `among`,
        the group we averaged `round_` with (RunView.diverged)."""
        return self.view().diverged(round_, digest, among, served)

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
        if time.monotonic() - self._configs_read_at >= CONFIG_READ_SECONDS:
            self._configs_read_at = time.monotonic()
            differences = self._differences({fingerprint for _, fingerprint in shown})
        else:  # read within CONFIG_READ_SECONDS: their fingerprints only
            differences = {fingerprint: f"fingerprint={records.shown_value(fingerprint)}" for _, fingerprint in shown}
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
                self._release_stale_hold()
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
