"""This node's membership in the swarm: the DHT, the presence heartbeat, the round barrier, the
transport of encoded pseudo-gradients (`offer` ours, `gather` the group's) and state sharing. It
moves bytes and knows nothing of what they mean (decoding and averaging live in outer/). The rest
of the package never sees hivemind.

Groups form through hivemind's DecentralizedAverager: its DHT matchmaking, timeouts and retries
find the peers averaging the same round, and its all-gather carries each member's token count.
The averager only all-reduces a one-element dummy; the pseudo-gradients themselves travel through
PayloadExchange (see exchange.py for why); state downloads go through statesync.py (see there for
why not hivemind's). Every peer we deal with is checked in our own handlers: a group member, a
fetcher or a state server counts only with a verified record of this run (records.py), which in a
permissioned run also carries a valid admission (admission.py). Rounds never mix: the matchmaking
key carries the round number, so only peers averaging the same round can meet, and the run id +
config fingerprint are part of the averager's prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from diloco_node import identity
from diloco_node.admission import Gate
from diloco_node.codec import max_payload_bytes
from diloco_node.swarm import records
from diloco_node.swarm.butterfly import BEYOND_TIMEOUT, Butterfly, PartSource, Reduced, owners
from diloco_node.swarm.contacts import Contacts
from diloco_node.swarm.exchange import Fetched, PayloadExchange
from diloco_node.swarm.groups import group_key, random_groups
from diloco_node.swarm.isolation import Isolation
from diloco_node.swarm.pacing import pace_leader_search
from diloco_node.swarm.presence import Presence
from diloco_node.swarm.reachability import DialBack, detect
from diloco_node.swarm.statesync import StateService, download_run_state

logger = logging.getLogger(__name__)

pace_leader_search()  # before any averager is forked (swarm/pacing.py)

ROUND_BITS = 24  # group key bits carrying the round number (mod 2**24)
BOOTSTRAP_ATTEMPTS = 3
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
# A leaving node waits this long for its last butterfly group to read the part it averaged (their
# pushes are answered as soon as it reduced the part: this is only the answers still on the wire)
ANSWER_DRAIN_SECONDS = 10.0
EXCHANGE_SLACK = BEYOND_TIMEOUT + 5.0  # a butterfly's longest, beyond the round timeout

# What a joiner downloads: the round's metadata and flat fp32 vectors (φ, momentum, rounds in flight)
StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class SwarmError(RuntimeError):
    """A problem joining or talking to the swarm, phrased as one line for the user."""


@dataclass(frozen=True)
class SwarmSettings:
    run_id: str
    fingerprint: str
    config: dict[str, Any]  # the fingerprinted fields, shown to peers when refusing them
    initial_peers: Sequence[str]
    listen: Sequence[str]
    announce: Sequence[str]
    matchmaking_time: float
    round_timeout: float
    group_size: int | None = None  # NoLoCo: at most this many per group; None: one group for everyone
    identity: Path | None = None  # libp2p key file (identity.py); None: a new peer id each start
    gate: Gate | None = None  # who is admitted (admission.py); None: an open run
    # groups of at least this many exchange by butterfly (butterfly.py), smaller ones by all-gather;
    # None: always all-gather. Fingerprinted config decides it, so every member of a group agrees.
    butterfly_from: int | None = None
    butterfly_possible: bool = False  # whether the run can exchange by butterfly (a group with a client must)
    reachability: str = "auto"  # public, private or auto (reachability.py)


@dataclass(frozen=True)
class Gathered:
    """What the transport moved for one round: the group's other payloads, undecoded."""

    verdict: str  # the barrier's: together, alone (nobody else in the run), behind, stopped
    round: int = -1
    payloads: dict[str, tuple[bytes, float]] = dataclasses.field(default_factory=dict)  # peer → (payload, tokens)
    transfer_seconds: float = 0.0
    received_bytes: int = 0
    reduced: Reduced | None = None  # butterfly: the averaged parts (then `payloads` is empty)


class SwarmMember:
    def __init__(self, settings: SwarmSettings, numel: int, state_provider: StateProvider, state_vectors: int,
                 payload_parts: int = 1):
        """`state_vectors`: the most flat vectors a shared state may hold, `payload_parts`: encoded
        vectors per payload (NoLoCo sends φ after Δ); both bound what a peer may send us."""
        self.settings = settings
        self.gate = settings.gate or Gate(settings.run_id)
        self._dht, signed_by = _start_dht(settings)
        self.peer_id = str(self._dht.peer_id)
        namespace = f"{settings.run_id}_{settings.fingerprint}"
        self.client = _is_client(settings, self._dht, namespace)
        isolation = Isolation(Contacts(self._dht, self.peer_id, settings.initial_peers), settings.run_id)
        self.presence = Presence(self._dht, self.peer_id, settings.run_id, settings.fingerprint, settings.config,
                                 isolation, signed_by, self.gate, self.client)
        self._averager = DecentralizedAverager(
            [torch.zeros(1)], self._dht, start=True, prefix=namespace,
            min_matchmaking_time=settings.matchmaking_time, request_timeout=min(3.0, settings.matchmaking_time / 2),
            next_chunk_timeout=NEXT_CHUNK_TIMEOUT, allreduce_timeout=settings.round_timeout, allow_state_sharing=False,
            target_group_size=settings.group_size, client_mode=self.client)
        self._draw: tuple[int, list[list[str]]] | None = None  # NoLoCo: the last round's groups
        self._exchange = PayloadExchange(self._dht, namespace, payload_parts * max_payload_bytes(numel),
                                         self._may_fetch_payload, self.gate.token)
        self._state_provider = state_provider
        self._sharing = threading.Event()
        self._state_bytes = [0, 0]  # sent, received: state shared with / downloaded from joiners
        self._state_bytes_lock = threading.Lock()
        self._state = StateService(self._exchange.p2p, self._exchange.loop, namespace, numel, state_vectors,
                                   self._serve_state, self.gate.refusal, self.gate.token,
                                   on_moved=lambda sent, received: self._count_state(sent, received))
        self._exchange.run(self._state.attach(), timeout=30)
        self._butterfly = Butterfly(self._exchange.p2p, self._exchange.loop, namespace,
                                    payload_parts * max_payload_bytes(numel), self._may_fetch_payload,
                                    self.gate.token, self._exchange.count, settings.round_timeout)
        self._exchange.run(self._butterfly.attach(), timeout=30)
        self._dial_back = DialBack(self._exchange.p2p, namespace)
        self._exchange.run(self._dial_back.attach(), timeout=30)
        self._sources: dict[int, PartSource] = {}  # butterfly: what we bring to each round we offered
        self._numel = numel
        # hivemind's averager talks to its process over a pipe that is not safe to share between
        # threads; the exchange may run on a background thread (sync modes), so every call is locked.
        self._averager_lock = threading.Lock()

    # --- membership -------------------------------------------------------------------------

    def visible_addresses(self) -> list[str]:
        return [str(addr) for addr in self._dht.get_visible_maddrs()]

    def share_state(self) -> None:
        """Let others download our state."""
        self._sharing.set()

    def stop_sharing(self) -> None:
        """A node whose φ is about to change or is known to be off must not hand it to joiners."""
        self._sharing.clear()

    def _serve_state(self, peer: str) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Our state for `peer` (on the exchange's executor), None while we do not share. A joiner
        handed rounds in flight is vouched for: it fetches those rounds' payloads from our group."""
        if not self._sharing.is_set():
            return None
        metadata, vectors = self._state_provider()
        if metadata.get("in_flight"):
            self.presence.vouch(peer)
        return metadata, vectors

    def download_state(self, timeout: float, stop: threading.Event, check_digest: bool,
                       held: tuple[int, str] | None = None) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """φ and the outer state from a peer (statesync.download_run_state); None when nobody else
        is in the run (we start it), the run's state is `held` already, nobody shared it in time,
        or `stop` was set."""
        def others() -> dict[str, records.NodeRecord]:
            # a client cannot be dialled: it serves no state, and its announcements are not asked for
            return {p: r for p, r in self.presence.compatible_peers(refresh=True).items()
                    if p != self.peer_id and not r.client}

        return download_run_state(self._state, self._exchange.run, others, timeout, stop, check_digest, held)

    def _count_state(self, sent: int = 0, received: int = 0) -> None:
        with self._state_bytes_lock:  # hivemind's thread counts what it serves, ours what we download
            self._state_bytes[0] += sent
            self._state_bytes[1] += received

    def _may_fetch_payload(self, peer: str, round_: int, token: str, group: tuple[str, ...] | None) -> str | None:
        """Why `peer` may not fetch our payload of `round_` (None: it may). Once our group is known:
        its members, and joiners a member vouched for (they complete rounds their server had in
        flight). Before: any verified node of the run, since our matchmaking may still be running
        or have failed one-sided (see _missed_group)."""
        if why := self.gate.refusal(peer, token):
            return why
        if group is None:
            return None if self.presence.known(peer, refresh=True) else "not a verified node of this run"
        if peer in group:
            return None
        for refresh in (False, True):  # a fresh vouch may not have reached our last look at the records
            vouchers = self.presence.compatible_peers(refresh=refresh)
            if any(peer in vouchers[member].vouched for member in group if member in vouchers):
                return None
        return "not a member of the round's group"

    def traffic(self) -> tuple[int, int]:
        """(bytes sent, bytes received) of payloads and shared state since start."""
        return (self._exchange.bytes_sent + self._state_bytes[0], self._exchange.bytes_received + self._state_bytes[1])

    # --- rounds: the transport (DESIGN §2) ----------------------------------------------------

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: PartSource | None = None) -> None:
        """Make our encoded contribution to `round_` fetchable by its group (None: we have none);
        `parts`: what we push and reduce if the round's group exchanges by butterfly."""
        if payload is not None:
            self._exchange.offer(round_, payload, tokens)
        if parts is not None:
            self._sources[round_] = parts
            for old in [r for r in self._sources if r < round_ - 2]:
                del self._sources[old]

    def _clients(self, group: Collection[str]) -> list[str]:
        """The members of `group` that accept no inbound connection (reachability.py)."""
        return sorted(p for p in group if (p == self.peer_id and self.client) or
                      (p != self.peer_id and (record := self.presence.known(p)) is not None and record.client))

    def _by_butterfly(self, group: Collection[str]) -> bool:
        """Whether `group` exchanges by butterfly: big enough for it, or holding a client (nobody can
        fetch a client's payload). Every member decides alike from the group and the run's config."""
        threshold = self.settings.butterfly_from
        big = threshold is not None and len(group) >= threshold
        return big or (self.settings.butterfly_possible and bool(self._clients(group)))

    def _butterfly_for(self, round_: int, group: Collection[str]) -> PartSource | None:
        """What we bring to `round_`'s butterfly, when `group` exchanges by butterfly."""
        return self._sources.get(round_) if self._by_butterfly(group) else None

    def gather(self, round_: int, contributing: bool, stop: threading.Event,
               among: Collection[str] | None = None, on_ready: Callable[[], None] | None = None) -> Gathered:
        """The other members' payloads for `round_`: wait until the run (or `among`, NoLoCo's drawn
        group) is ready, call `on_ready`, form the group, fetch. Safe off the main thread; `stop`
        ends the wait."""
        verdict = self.presence.wait_for_round(round_, self.settings.round_timeout, stop, among=among)
        if verdict == "alone":
            # our offer says so: a joiner that took our state with this round in flight completes it
            # from our payload at once, instead of waiting a round timeout for a group never formed
            self._exchange.expect(round_, [self.peer_id], self.peer_id)
        if verdict in ("stopped", "behind", "alone"):
            return Gathered(verdict, round_)
        if on_ready is not None:
            on_ready()
        others, fetched = self._find_group(round_, contributing)
        if not others and contributing and self._drawn_group_failed_too(round_):
            logger.info("round=%d matchmaking failed for our whole drawn group; trying once more", round_)
            others, fetched = self._find_group(round_, contributing)
        if not others:
            logger.warning("round=%d no peer averaged with us", round_)
        started = time.perf_counter()  # the transfer, once the group is known
        group = [self.peer_id, *others]
        if (source := self._butterfly_for(round_, group)) is not None:
            self._exchange.expect(round_, group, self.peer_id, fetched=False)
            clients = self._clients(group)
            if len(clients) == len(group):
                logger.warning("round=%d our group holds only clients, which cannot reach one another", round_)
                return Gathered("alone", round_)
            try:
                reduced = self._exchange.run(self._butterfly.exchange(
                    round_, group, self.peer_id, clients, self._numel, source,
                    self.settings.round_timeout), timeout=self.settings.round_timeout + EXCHANGE_SLACK, stop=stop)
            except TimeoutError:
                return Gathered("stopped" if stop.is_set() else verdict, round_)
            return Gathered(verdict, round_, {}, time.perf_counter() - started,
                            sum(len(part) for part, _ in reduced.parts.values()), reduced)
        self._exchange.run(self._butterfly.close(round_), timeout=5)  # nobody waits on us for a part
        if contributing:
            self._exchange.expect(round_, [self.peer_id, *others], self.peer_id)
        fetched.update(self._exchange.fetch_all([p for p in others if p not in fetched], round_,
                                                self.settings.round_timeout))
        payloads = {peer: (item.payload, item.tokens) for peer, item in fetched.items() if item is not None}
        return Gathered(verdict, round_, payloads, time.perf_counter() - started,
                        sum(len(payload) for payload, _ in payloads.values()))

    def gather_group_of(self, round_: int, member: str) -> Gathered:
        """The payloads `member`'s group averaged in `round_`, `member`'s own included, fetched from
        them (offers stay up for a few rounds): how a joiner completes a round its server had in
        flight when it shared its state. Empty when `member` has not formed that group (yet)."""
        deadline = time.monotonic() + self.settings.round_timeout
        while True:  # its group is known once its matchmaking has ended, which may still be under way
            first = self._exchange.fetch_all([member], round_, self.settings.round_timeout).get(member)
            if first is None or (first.group is not None and member in first.group):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(GROUP_POLL_SECONDS)
        if first is None or first.group is None or member not in first.group:
            return Gathered("alone", round_)
        if self._by_butterfly(first.group):
            return self._parts_held_by(member, round_, deadline)
        others = [peer for peer in first.group if peer not in (member, self.peer_id)]
        fetched = {member: first, **self._exchange.fetch_all(others, round_, self.settings.round_timeout)}
        payloads = {peer: (item.payload, item.tokens) for peer, item in fetched.items() if item is not None}
        return Gathered("together", round_, payloads)

    def _parts_held_by(self, member: str, round_: int, deadline: float) -> Gathered:
        """The averaged parts of a butterfly round `member` took part in, once its exchange has ended."""
        while True:
            try:
                held = self._exchange.run(self._butterfly.fetch_parts(member, round_, self.settings.round_timeout),
                                          timeout=self.settings.round_timeout)
            except Exception as exc:  # a network or peer failure: that round is lost for us
                logger.warning("round=%d could not fetch the averaged parts from peer=%s: %s", round_, member,
                               type(exc).__name__)
                return Gathered("alone", round_)
            if held is not None:
                group, parts = held
                return Gathered("together", round_, reduced=Reduced(group, len(owners(group)), parts, None))
            if time.monotonic() > deadline:
                return Gathered("alone", round_)
            time.sleep(GROUP_POLL_SECONDS)

    def drawn_groups(self, round_: int) -> list[list[str]]:
        """NoLoCo: the groups of `round_` as we see the run, drawn once per round so that waiting
        for our group and matchmaking with it agree even if a peer joins or leaves in between."""
        assert self.settings.group_size, "groups are drawn for NoLoCo only"
        if self._draw is None or self._draw[0] != round_:
            # A node that left after exchanging this round still counts: nodes that draw after it
            # left then draw the same groups as those that drew before (a run's end, a volunteer's Ctrl-C).
            peers = [*self.presence.compatible_peers(), *self.presence.departed_after(round_)]
            self._draw = (round_, random_groups(peers, self.settings.run_id, round_, self.settings.group_size))
        return self._draw[1]

    def drawn_group(self, round_: int) -> list[str]:
        """NoLoCo: who we are drawn to average with in `round_`, ourselves included."""
        return next((group for group in self.drawn_groups(round_) if self.peer_id in group), [self.peer_id])

    def _find_group(self, round_: int, contributing: bool) -> tuple[list[str], dict[str, Fetched | None]]:
        """The other members of our group for `round_`, and any payloads already fetched from them."""
        group, formed = self._form_group(round_)
        others = [peer for peer in group if peer != self.peer_id]
        if others or not contributing:  # nobody fetches from a node that offered nothing
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
            if claimed := self._exchange.run(self._butterfly.claimed_group(round_, self.peer_id), timeout=5):
                others = [p for p in claimed if p != self.peer_id]
                if self._butterfly_for(round_, claimed) is None or \
                        not all(self.presence.known(p, refresh=True) for p in others):
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
        if not all(self.presence.known(p, refresh=True) for p in others):
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
        return bool(partners) and self.presence.round_state(round_, among=partners) == "together"

    def _anyone_may_still_fetch(self, round_: int) -> bool:
        return any(self._may_still_fetch(peer, round_) for peer in self.presence.compatible_peers()
                   if peer != self.peer_id)

    def _form_group(self, round_: int) -> tuple[list[str], bool]:
        """Matchmake with the peers averaging `round_`: their peer ids, ourselves included, and
        whether a group had formed (False when matchmaking found none: then the list is just us)."""
        bits = format(round_ % 2**ROUND_BITS, f"0{ROUND_BITS}b")
        if self.settings.group_size:  # NoLoCo: only our drawn group shares the key (see groups.py)
            bits += group_key(self.peer_id, self.drawn_groups(round_))
        # Matchmaking starts once the group's members are ready (DiLoCo's barrier over the run,
        # NoLoCo's over its drawn group), so it needs a few windows at most; a node that missed its
        # group fails fast instead of holding up the next round's barrier for the whole round timeout.
        timeout = min(self.settings.round_timeout, 4 * self.settings.matchmaking_time + MATCHMAKING_SLACK)
        try:
            with self._averager_lock:
                self._averager.set_group_bits(bits)
                control = self._averager.step(
                    gather={"round": round_}, timeout=timeout,
                    scheduled_time=get_dht_time() + self.settings.matchmaking_time, wait=False)
            gathered = control.result()
        except Exception as exc:  # hivemind surfaces timeouts and peer failures as assorted types
            logger.warning("round=%d no group formed (%s)", round_, type(exc).__name__)
            # the group formed and its all-reduce failed on our side only: its leader may still
            # complete it with us counted in, after its own wait for our part (sender_timeout)
            return [self.peer_id], isinstance(exc, AllreduceException)
        group = [self.peer_id]
        for peer, info in (gathered or {}).items():
            if str(peer) == self.peer_id:
                continue
            if not (isinstance(info, dict) and info.get("round") == round_):
                logger.warning("round=%d ignored peer=%s: malformed group metadata", round_, peer)
            elif not self.presence.known(str(peer), refresh=True):  # hivemind's matchmaking admits anyone
                logger.warning("round=%d ignored peer=%s in our group: no verified record of this run", round_, peer)
            else:
                group.append(str(peer))
        return group, True

    # --- lifecycle ----------------------------------------------------------------------------

    def _may_still_fetch(self, peer: str, round_: int) -> bool:
        record = self.presence.compatible_peers().get(peer)
        return record is not None and record.may_still_fetch(round_)

    def leave(self) -> None:
        admitted = self.gate.refusal(self.peer_id, self.gate.token) is None  # revoked: nobody fetches from us
        if admitted and not self._exchange.drain(self.settings.round_timeout, self._may_still_fetch):
            logger.warning("leaving before every group member fetched our last pseudo-gradient")
        deadline = time.monotonic() + ANSWER_DRAIN_SECONDS
        while admitted and self._exchange.run(self._butterfly.unanswered(), timeout=5):
            if time.monotonic() > deadline:
                logger.warning("leaving before every group member read the part we averaged")
                break
            time.sleep(GROUP_POLL_SECONDS / 2)
        self.presence.leave()
        try:
            self._exchange.run(self._dial_back.detach(), timeout=5)
            self._exchange.run(self._butterfly.detach(), timeout=5)
            self._exchange.run(self._state.detach(), timeout=5)
        except Exception as exc:  # leaving must not fail; the handler goes with the daemon anyway
            logger.debug("closing the state service failed: %r", exc)
        self._exchange.close()
        self._averager.shutdown()
        self._dht.shutdown()


def _start_dht(settings: SwarmSettings) -> tuple[DHT, RSASignatureValidator]:
    """Start hivemind's DHT under our libp2p identity, and the signer of our records holding that
    identity's key; a first contact that fails is retried, since busy peers answer late."""
    path = settings.identity or identity.ephemeral()
    try:
        identity.create(path)
        signed_by = records.signer(identity.load(path))
        attempt = 1
        while True:
            try:
                return DHT(initial_peers=list(settings.initial_peers), host_maddrs=list(settings.listen),
                           announce_maddrs=list(settings.announce) or None, start=True, startup_timeout=30,
                           record_validators=records.validators(settings.run_id, signed_by),
                           identity_path=str(path), client_mode=settings.reachability == "private"), signed_by
            except Exception as exc:  # hivemind reports p2pd and bootstrap failures as generic errors
                message = _explain_start_failure(settings, exc)
                if attempt == BOOTSTRAP_ATTEMPTS or not message.startswith("cannot reach"):
                    raise SwarmError(message) from None
                logger.warning("attempt=%d %s; retrying", attempt, message)
                attempt += 1
    finally:
        if settings.identity is None:  # p2pd has read it; a key of a node that keeps no identity leaves no trace
            shutil.rmtree(path.parent, ignore_errors=True)


def _is_client(settings: SwarmSettings, dht: DHT, namespace: str) -> bool:
    """Whether we join as a client (reachability.py): declared, or no peer could dial us back."""
    if settings.reachability != "auto":
        return settings.reachability == "private"
    reachable = detect(dht, namespace, settings.initial_peers)
    if reachable is False:
        if not settings.butterfly_possible:
            raise SwarmError("no peer can connect to this node (behind a NAT?), and this run exchanges by all-gather, "
                             "which needs it: forward a port and --announce it, or join a run that can use butterfly")
        logger.warning("no peer can connect to this node (behind a NAT?): joining as a client")
    elif reachable is None and settings.initial_peers:
        logger.info("no peer could tell whether it can connect to us; taking us as reachable")
    return reachable is False


def publish_revocation(initial_peers: Sequence[str], run_id: str, token: str) -> None:
    """Store the owner's revocation `token` in the run's DHT (reached through `initial_peers`)."""
    try:
        dht = DHT(initial_peers=list(initial_peers), start=True, client_mode=True, startup_timeout=30,
                  record_validators=records.validators(run_id, RSASignatureValidator()))
    except Exception as exc:  # hivemind reports bootstrap failures as generic errors
        raise SwarmError(f"cannot reach any peer ({', '.join(initial_peers)}): {str(exc).splitlines()[0]}") from None
    try:
        if not records.publish_revocation(dht, run_id, token):
            raise SwarmError("no node of the run stored the revocation")
    finally:
        dht.shutdown()


def _explain_start_failure(settings: SwarmSettings, exc: Exception) -> str:
    text = str(exc)
    if "already taken" in text:  # hivemind checks that no live peer holds this identity
        return (f"identity {settings.identity} is in use by another running node; "
                "give each node its own --identity")
    if "address already in use" in text.lower():
        return f"cannot listen on {', '.join(settings.listen)}: address already in use"
    if settings.initial_peers and ("bootstrap" in text.lower() or "connect" in text.lower()):
        return f"cannot reach any peer ({', '.join(settings.initial_peers)}): {text.splitlines()[0]}"
    return f"cannot start the swarm node: {text.splitlines()[0] if text else type(exc).__name__}"
