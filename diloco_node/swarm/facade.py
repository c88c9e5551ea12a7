"""This node's membership in the swarm, behind one facade: the round loop and outer/ see this class
(outer/ only as round.Transport), never hivemind or the parts it is made of (docs/architecture.md §2):

- dht.py: start-up of hivemind's DHT under our identity, and whether peers can dial us
- presence.py: the heartbeat, the records of who is in the run and where, the round barrier
- matchmaking.py: who averages a round with us
- transfer.py: moving a round's payloads within the group (exchange.py all-gather, butterfly.py)
- statesync.py: serving our state to joiners and downloading the run's

Every peer we deal with is checked in our own handlers: a group member, a fetcher or a state server
counts only with a verified record of this run (records.py), which in a permissioned run also
carries a valid admission (trust/admission.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

import torch
from hivemind.utils import get_dht_time

from diloco_node.round import Gathered, Outcome, PartSource, held
from diloco_node.swarm import bounded
from diloco_node.swarm.butterfly import Butterfly
from diloco_node.swarm.contacts import Contacts
from diloco_node.swarm.dht import SwarmSettings, is_client, start_dht
from diloco_node.swarm.exchange import PayloadExchange
from diloco_node.swarm.isolation import Isolation
from diloco_node.swarm.manifests import ManifestService
from diloco_node.swarm.matchmaking import Matchmaker, start_averager
from diloco_node.swarm.presence import Presence
from diloco_node.swarm.reachability import DialBack
from diloco_node.swarm.spread import RoundClock, Spread
from diloco_node.swarm.statesync import (
    CatchUp,
    DisputedState,
    StateService,
    await_one_state,
    download_run_state,
)
from diloco_node.swarm.streams import Streams
from diloco_node.swarm.throttle import Throttle
from diloco_node.swarm.transfer import Transfer
from diloco_node.swarm.watchdog import Watchdog
from diloco_node.trust import proofs, view
from diloco_node.trust.admission import Gate
from diloco_node.trust.records import NodeRecord
from diloco_node.trust.state import AGREEMENT_WAIT_SECONDS

logger = logging.getLogger(__name__)

# What a joiner downloads: the round's metadata and flat fp32 vectors (φ, momentum, rounds in flight)
StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class Swarm:
    def __init__(self, settings: SwarmSettings, numel: int, state_provider: StateProvider, state_vectors: int):
        """`state_vectors`: the most flat vectors a shared state may hold; it and the settings'
        `max_payload_bytes` bound what a peer may send us."""
        self.settings = settings
        self.gate = settings.gate or Gate(settings.run_id)
        self._dht, signed_by, sealer = start_dht(settings)
        self.peer_id = bounded.peer_id(self._dht)
        self.min_group_size = settings.min_group_size
        # the last rounds we held, and those of them whose exchanged mark waits for the next barrier
        # (see _held); guarded: overlapped exchanges run on threads
        self._held_rounds: set[int] = set()
        self._deferred_marks: set[int] = set()
        self._held_lock = threading.Lock()
        self._spread: Spread | None = None  # how the next offer is served (spread_offers)
        namespace = f"{settings.run_id}_{settings.fingerprint}"
        self.client = is_client(settings, self._dht, namespace)
        isolation = Isolation(Contacts(self._dht, self.peer_id, settings.initial_peers), settings.run_id)
        self._presence = Presence(self._dht, self.peer_id, settings.run_id, settings.fingerprint, settings.config,
                                  isolation, signed_by, self.gate, self.client,
                                  anchors=proofs.anchor_ids(settings.initial_peers))
        averager = start_averager(self._dht, namespace, settings, self.client)  # forks: before our threads
        self._streams = Streams(self._dht, Throttle(settings.upload_limit, settings.download_limit))
        self._exchange = PayloadExchange(self._streams, namespace, settings.max_payload_bytes,
                                         self._may_fetch_payload, self.gate.token)
        self._streams.trusted = self._trusted
        self._exchange.attach()
        self._state_provider = state_provider
        self._sharing = threading.Event()
        self._state = StateService(self._streams, namespace, numel, state_vectors, self._serve_state,
                                   self.gate.refusal, self.gate.token, on_shared=self._shared_state)
        self._state.attach()
        self._butterfly = Butterfly(self._streams, namespace, settings.max_payload_bytes, self._may_fetch_payload,
                                    self.gate.token, settings.round_timeout, sealer)
        if settings.butterfly_possible:  # an all-gather run serves no part: no handler to read pushes on
            self._butterfly.attach()
        self._dial_back = DialBack(self._streams, namespace)
        self._dial_back.attach()
        self._manifest = ManifestService(self._streams, settings.manifest, settings.manifest_signature) \
            if settings.manifest else None
        if self._manifest is not None:
            self._manifest.attach()
        self._transfer = Transfer(settings, self.peer_id, self.client, numel, self._presence, self._streams,
                                  self._exchange, self._butterfly)
        self._matchmaker = Matchmaker(averager, settings, self.peer_id, self._presence, self._streams,
                                      self._exchange, self._butterfly, self._transfer.butterfly_for)
        self._watchdog = Watchdog({"DHT": self._dht, "averager": averager})

    # --- membership ---------------------------------------------------------------------------

    def visible_addresses(self) -> list[str]:
        return bounded.visible_maddrs(self._dht)

    def watch(self, on_isolation: Callable[[float | None], None], on_revoked: Callable[[], None],
              on_helper_dead: Callable[[str], None]) -> None:
        """Called on the heartbeat's thread: when we are cut off from every peer or back (the time
        it began, None when back), and when the run owner revoked our admission; on the watchdog's
        thread, once: when one of hivemind's helper processes died (why, in one line)."""
        self._presence.isolation.on_change = on_isolation
        self._presence.on_revoked = on_revoked
        self._watchdog.start(on_helper_dead)

    def check_compatible(self) -> None:
        """IncompatibleRun when the run's live nodes all use another config."""
        self._presence.check_compatible()

    def enter(self, round_: int, digest: str, served: tuple[int, str]) -> None:
        """Announce ourselves as a member at `round_` (after any state download) and start the heartbeat."""
        self._presence.enter(round_, digest, served)

    def announce(self, round_: int, ready: bool, digest: str, served: tuple[int, str]) -> None:
        """We train `round_` (ready=False) or are done with its inner phase; `digest`: φ's at its
        start; `served`: the (settled round, digest) of the state we serve."""
        self._presence.announce(round_, ready, digest, served)

    def publish_stats(self, stats: dict[str, Any]) -> None:
        """Our row of the swarm table; it goes out with the next announcement."""
        self._presence.publish_stats(**stats)

    def peer_stats(self) -> dict[str, dict[str, Any]]:
        """Each live node's published stats (ourselves included), for the swarm table."""
        return {peer: dict(record.stats) for peer, record in self._presence.compatible_peers().items()}

    def wait_for_peers(self, count: int, stop: threading.Event) -> bool:
        return self._presence.wait_for_peers(count, stop)

    def isolated(self) -> bool:
        return self._presence.isolated()

    def ahead_of(self, round_: int) -> bool:
        """Whether most other live nodes have already exchanged `round_` (we are behind)."""
        return self._presence.ahead_of(round_)

    def all_past(self, round_: int) -> bool:
        return self._presence.all_past(round_)

    def past_inner_phase(self, round_: int) -> bool:
        """Whether most other live nodes have ended their inner phase of `round_` (its deadline passed)."""
        return self._presence.past_inner_phase(round_)

    @staticmethod
    def clock() -> float:
        """The swarm's clock (hivemind's DHT time, by which every record expires): round deadlines
        under --round-seconds are points of it (daemon/budget.py)."""
        return float(get_dht_time())

    def peer_count(self) -> int:
        return len(self._presence.compatible_peers())

    def diverged(self, round_: int, digest: str, among: Collection[str]) -> bool:
        return self._presence.diverged(round_, digest, among)

    def served_diverged(self, among: Collection[str]) -> bool:
        return self._presence.served_diverged(among)

    def mark_exchanged(self, round_: int) -> None:
        with self._held_lock:
            if round_ in self._held_rounds:
                self._deferred_marks.add(round_)
                return  # once we pass the next barrier (_held)
        self._presence.mark_exchanged(round_)

    def _mark_held_before(self, round_: int) -> None:
        """We passed `round_`'s barrier, so every peer we waited for has left the held rounds before it."""
        with self._held_lock:
            done = sorted(r for r in self._deferred_marks if r < round_)
            self._deferred_marks -= set(done)
        for held_round in done:
            self._presence.mark_exchanged(held_round)

    def prove(self, round_: int, peers: Collection[str]) -> None:
        """`peers`' contributions passed our checks and went into the mean we applied in `round_`
        (the AverageResult's group): they are proven peers (trust/proofs.py)."""
        self._presence.prove(round_, peers)

    def _trusted(self, peer: str) -> bool:
        """Whether `peer` may take the stream slots strangers cannot (streams.Limits.reserved): a
        peer proven within the last rounds, an anchor, a joiner we served, or a member of a group of
        ours; in a permissioned run also any node whose verified record we hold, since that record
        carries the owner's admission (a joiner asking for our state among them). In an open run a
        record is not enough: its records are free."""
        return (peer in self._presence.proofs.proven() or peer in self._presence.anchors
                or self._presence.vouched(peer) or self._exchange.in_group(peer)
                or (self.gate.permissioned and self._presence.known(peer) is not None))

    def _may_fetch_payload(self, peer: str, round_: int, token: str, group: tuple[str, ...] | None) -> str | None:
        """Why `peer` may not fetch our payload of `round_` (None: it may): the gate's admission,
        then trust/view.fetch_refusal, with the records as they are here. A joiner we served is
        verified before its first record reaches us; a fresh vouch may not have reached our last
        look at the records, which are read again for it."""
        if why := self.gate.refusal(peer, token):
            return why

        def verified() -> bool:
            return bool(self._presence.vouched(peer) or self._presence.known(peer)
                        or self._presence.recent_peers().get(peer))

        def vouched_by_member() -> bool:
            assert group is not None
            for vouchers in (self._presence.compatible_peers(), self._presence.recent_peers()):
                if any(peer in vouchers[member].vouched for member in group if member in vouchers):
                    return True
            return False

        return view.fetch_refusal(peer, group, verified, vouched_by_member)

    # --- rounds: the transport (round.Transport) ----------------------------------------------

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: PartSource | None = None) -> None:
        self._transfer.offer(round_, payload, tokens, parts, self._spread)

    def spread_offers(self, clock: RoundClock) -> None:
        """Serve the next offers across the round `clock` expects, to every other live node of the run
        (the all-gather's fetchers; docs/architecture.md §15, spread.py)."""
        self._spread = clock.spread(max(self.peer_count() - 1, 1))

    def gather(self, round_: int, contributing: bool, stop: threading.Event,
               among: Collection[str] | None = None, on_ready: Callable[[], None] | None = None) -> Gathered:
        """The other members' payloads for `round_`: wait until the run (or `among`, NoLoCo's drawn
        group) is ready, call `on_ready`, form the group, fetch. Safe off the main thread; `stop`
        ends the wait."""
        timeout = self.settings.barrier_timeout or self.settings.round_timeout
        spare = False
        if among is not None and not among:  # NoLoCo's odd one out: no drawn partner to wait for
            among = self._presence.odd_spare_partners(round_, self._matchmaker.drawn_groups(round_), timeout, stop)
            spare = bool(among)
            outcome = Outcome.STOPPED if stop.is_set() else Outcome.TOGETHER if spare else Outcome.ALONE
            if spare:
                logger.info("round=%d drawn alone; matchmaking under the spare key with %s", round_, ", ".join(among))
        else:
            outcome = self._presence.wait_for_round(round_, timeout, stop, among=among)
        # whom to matchmake with: trust/view.py decides (NoLoCo's kept and spare partners, rounds
        # with strangers only), the transport acts and says so
        partners = self._presence.view().partners(round_, outcome, among, spare,
                                                  lambda: self._matchmaker.drawn_groups(round_), self._presence.proofs)
        outcome, among, spare = partners.outcome, partners.among, partners.spare
        if partners.respared:
            logger.info("round=%d drawn partners all dropped; matchmaking once more with %s",
                        round_, ", ".join(among or ()))
        if partners.skipped:  # the last matchmakings with only unproven peers about found nobody (trust/proofs.py)
            logger.info("round=%d not matchmaking: no peer about is proven or new, and the last "
                        "matchmaking with them found nobody", round_)
        if outcome == Outcome.ALONE and held(1, self.min_group_size):
            self._mark_held_before(round_)
            return self._held(round_, 1)
        if outcome == Outcome.ALONE:
            self._transfer.alone(round_)
        if outcome in (Outcome.STOPPED, Outcome.BEHIND, Outcome.ALONE):
            return Gathered(outcome, round_)
        self._mark_held_before(round_)
        # fewer nodes than the minimum in sight (or drawn with us): no matchmaking could form a group
        candidates = 1 + len(among) if among is not None else max(1, self.peer_count())
        if held(candidates, self.min_group_size):
            return self._held(round_, candidates)
        if on_ready is not None:
            on_ready()
        others, fetched = self._matchmaker.group_for(round_, contributing, spare, partners.strangers)
        if partners.unproven and not others:
            skip = self._presence.proofs.strangers_missed(round_)
            logger.info("round=%d matchmaking with unproven peers only found nobody; the next %d such "
                        "rounds go alone", round_, skip)
        if held(1 + len(others), self.min_group_size):
            return self._held(round_, 1 + len(others))
        return self._transfer.move(round_, outcome, others, fetched, contributing, stop)

    def _held(self, round_: int, size: int) -> Gathered:
        """A round whose group is smaller than --min-group-size: nothing is exchanged, φ takes no step.

        It is marked exchanged only once we pass the next round's barrier: a held round ends the
        moment the barrier lets us through, so a peer that had announced itself ready could still be
        on its way into this barrier, and would read our mark as the run having gone on without it
        (trust/view.py's moved_on) and re-sync for nothing. Its φ is ours, since nobody stepped."""
        with self._held_lock:
            self._held_rounds = {r for r in self._held_rounds if r >= round_ - 2} | {round_}
        logger.info("round=%d held: a group of %d is below --min-group-size %d, so no outer step",
                    round_, size, self.min_group_size)
        self._transfer.held(round_)
        return Gathered(Outcome.HELD, round_)

    def gather_group_of(self, round_: int, member: str) -> Gathered:
        return self._transfer.group_of(round_, member)

    def drawn_group(self, round_: int) -> list[str]:
        return self._matchmaker.drawn_group(round_)

    # --- state sharing ------------------------------------------------------------------------

    def watch_downloads(self, on_progress: Callable[[dict[str, Any] | None], None]) -> None:
        """`on_progress` hears where each state download of ours stands (statesync.StateService.watch)."""
        self._state.watch(on_progress)

    def share_state(self) -> None:
        """Let others download our state."""
        self._sharing.set()

    def stop_sharing(self) -> None:
        """A node whose φ is about to change or is known to be off must not hand it to joiners."""
        self._sharing.clear()

    def _serve_state(self, peer: str) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Our state for `peer` (on the streams' executor), None while we do not share."""
        if not self._sharing.is_set():
            return None
        return self._state_provider()

    def _shared_state(self, peer: str, metadata: dict[str, Any]) -> None:
        """A joiner we served is vouched for: the barrier waits for it in its first round
        (trust/proofs.py), and one handed rounds in flight fetches those rounds' payloads from our group."""
        self._presence.vouch(peer, metadata["round"])

    def download_state(self, timeout: float, stop: threading.Event, check_digest: bool,
                       held: tuple[int, str] | None = None, catch_up: CatchUp | None = None,
                       ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """φ and the outer state from a peer (statesync.download_run_state; `catch_up`: how a state
        the run moved past while it downloaded is brought up to the run's); None when nobody else
        is in the run (we start it), the run's state is `held` already, nobody shared it in time,
        or `stop` was set."""
        self._presence.read_revocations()  # a revoked server is not asked, even before our first heartbeat

        def others() -> dict[str, NodeRecord]:
            # a client cannot be dialled: it serves no state, and its announcements are not asked
            # for; only the records that decide (trust/proofs.py), in a fresh run our anchors,
            # choose the state and serve it: free identities announcing a state of their own
            # cannot outvote proven peers
            return {p: r for p, r in self._presence.state_peers().items() if not r.client}

        if check_digest and self._presence.unanchored():
            # no root of trust: k ≥ 2 forged identities announcing one state would pass the "two
            # agreeing servers" check, so the records must all name one state (docs/architecture.md §9)
            # a re-sync waits too, a round at most: one snapshot of honest nodes a step apart would
            # otherwise refuse it round after round while it falls further behind
            wait = AGREEMENT_WAIT_SECONDS if held is not None else \
                min(AGREEMENT_WAIT_SECONDS, self.settings.round_timeout)
            states = await_one_state(others, wait, stop)
            if states > 1 and not stop.is_set():
                why = (f"the run's records announce {states} different states and no --peers names a node "
                       f"of run {self.settings.run_id} to tell its own from forged ones")
                if held is not None:  # a fresh joiner: it would start a run of its own
                    raise DisputedState(f"refused to take the run's state: {why}; name one of its nodes with --peers")
                logger.warning("state download refused: %s; keeping our φ", why)
                return None
        return download_run_state(self._state, self._streams.run, others, timeout, stop, check_digest, held, catch_up)

    def traffic(self) -> tuple[int, int]:
        """(bytes sent, bytes received) of payloads and shared state since start."""
        return self._streams.bytes_sent, self._streams.bytes_received

    def peer_rates(self) -> dict[str, Any]:
        """Our streams' egress and ingress now, in total and for the busiest peers (peer_traffic.py)."""
        return self._streams.traffic.rates()

    # --- leaving ------------------------------------------------------------------------------

    def leave(self) -> None:
        self._watchdog.stop()  # the helpers are shut down on purpose from here on
        helpers_alive = self._watchdog.dead() is None
        if helpers_alive:
            if self.gate.refusal(self.peer_id, self.gate.token) is None:  # revoked: nobody fetches from us
                self._transfer.drain(self._presence.may_still_fetch)
            self._presence.leave()
        else:  # nobody can fetch from us or read a withdrawal; each DHT call would only wait out its timeout
            self._watchdog.end_orphans()
        for service in (self._manifest, self._dial_back, self._butterfly, self._state, self._exchange):
            if service is None:
                continue
            try:
                service.detach()
            except Exception as exc:  # leaving must not fail; the handler goes with the daemon anyway
                logger.debug("closing a stream service failed: %r", exc)
        self._streams.close()
        self._matchmaker.shutdown(graceful=helpers_alive)
        self._dht.shutdown()
