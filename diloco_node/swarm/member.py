"""This node's membership in the swarm: the DHT, the presence heartbeat, the round barrier, the
transport of encoded pseudo-gradients (`offer` ours, `gather` the group's) and state sharing. It
moves bytes and knows nothing of what they mean (decoding and averaging live in outer/). The rest
of the package never sees hivemind.

Groups form through hivemind's DecentralizedAverager: its DHT matchmaking, timeouts and retries
find the peers averaging the same round, and its all-gather carries each member's token count.
The averager only all-reduces a one-element dummy; the pseudo-gradients themselves travel through
PayloadExchange (see exchange.py for why). Its state download gives late joiners φ and the outer
state. Rounds never mix: the matchmaking key carries the round number, so only peers averaging the
same round can meet, and the run id + config fingerprint are part of the averager's prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time

from diloco_node.codec import max_payload_bytes
from diloco_node.swarm import records
from diloco_node.swarm.contacts import Contacts
from diloco_node.swarm.exchange import Fetched, PayloadExchange
from diloco_node.swarm.groups import group_key, random_groups
from diloco_node.swarm.isolation import Isolation
from diloco_node.swarm.presence import Presence

logger = logging.getLogger(__name__)

ROUND_BITS = 24  # group key bits carrying the round number (mod 2**24)
BOOTSTRAP_ATTEMPTS = 3
MATCHMAKING_SLACK = 5.0  # seconds beyond the matchmaking windows for DHT lookups on a loaded link
# After a failed matchmaking: how long a group that counted us in has to fetch our payload. Its
# members fetch as soon as their own matchmaking ends, which is before ours gives up.
MISSED_GROUP_GRACE = 2.0
GROUP_POLL_SECONDS = 0.5  # between asks for a group whose matchmaking is under way
STATE_RETRY_SECONDS = 1.0  # between state downloads that found no peer sharing

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


@dataclass(frozen=True)
class Gathered:
    """What the transport moved for one round: the group's other payloads, undecoded."""

    verdict: str  # the barrier's: together, alone (nobody else in the run), behind, stopped
    round: int = -1
    payloads: dict[str, tuple[bytes, float]] = dataclasses.field(default_factory=dict)  # peer → (payload, tokens)
    transfer_seconds: float = 0.0
    received_bytes: int = 0


class _StateSharingAverager(DecentralizedAverager):
    """get_current_state is hivemind's documented hook for what a joining peer downloads."""

    state_provider: StateProvider | None = None
    on_state_served: Callable[[int], None] | None = None

    def get_current_state(self):  # type: ignore[override]  # runs in our process, on hivemind's thread
        metadata, tensors = self.state_provider() if self.state_provider else ({}, [])
        if self.on_state_served:
            self.on_state_served(_tensor_bytes(tensors))
        return metadata, tensors, None


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SwarmMember:
    def __init__(self, settings: SwarmSettings, numel: int, state_provider: StateProvider, payload_parts: int = 1):
        """`payload_parts`: encoded vectors per payload (NoLoCo sends φ after Δ), for the size limit."""
        self.settings = settings
        self._dht = _start_dht(settings)
        self.peer_id = str(self._dht.peer_id)
        isolation = Isolation(Contacts(self._dht, self.peer_id, settings.initial_peers), settings.run_id)
        self.presence = Presence(self._dht, self.peer_id, settings.run_id, settings.fingerprint, settings.config,
                                 isolation)
        namespace = f"{settings.run_id}_{settings.fingerprint}"
        self._averager = _StateSharingAverager(
            [torch.zeros(1)], self._dht, start=True, prefix=namespace,
            min_matchmaking_time=settings.matchmaking_time, request_timeout=min(3.0, settings.matchmaking_time / 2),
            next_chunk_timeout=10.0, allreduce_timeout=settings.round_timeout, allow_state_sharing=False,
            target_group_size=settings.group_size)
        self._averager.state_provider = state_provider
        self._averager.on_state_served = lambda n: self._count_state(sent=n)
        self._draw: tuple[int, list[list[str]]] | None = None  # NoLoCo: the last round's groups
        self._exchange = PayloadExchange(self._dht, namespace, payload_parts * max_payload_bytes(numel))
        self._state_bytes = [0, 0]  # sent, received: state shared with / downloaded from joiners
        self._state_bytes_lock = threading.Lock()
        # hivemind's averager talks to its process over a pipe that is not safe to share between
        # threads; the exchange may run on a background thread (sync modes), so every call is locked.
        self._averager_lock = threading.Lock()

    # --- membership -------------------------------------------------------------------------

    def visible_addresses(self) -> list[str]:
        return [str(addr) for addr in self._dht.get_visible_maddrs()]

    def share_state(self, round_: int) -> None:
        """Let others download our state; a higher round makes us the preferred source."""
        with self._averager_lock:
            self._averager.state_sharing_priority = float(round_)
            self._averager.allow_state_sharing = True

    def stop_sharing(self) -> None:
        """A node whose φ is known to be off must not hand it to joiners."""
        with self._averager_lock:
            self._averager.allow_state_sharing = False

    def download_state(self, timeout: float, stop: threading.Event) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """φ and the outer state from a peer, retried within `timeout`; None when nobody else is in
        the run (we start it), nobody shared it in time, or `stop` was set while waiting."""
        deadline = time.monotonic() + timeout
        logger.info("downloading state from peers")
        while any(peer != self.peer_id for peer in self.presence.compatible_peers(refresh=True)):
            remaining = deadline - time.monotonic()
            received = self._download_once(remaining, stop) if remaining > 0 else None
            if received is not None or stop.is_set():
                return received
            if remaining <= 0:
                logger.warning("no peer shared its state within %.0fs; starting from our own φ", timeout)
                return None
            if stop.wait(STATE_RETRY_SECONDS):
                logger.warning("state download stopped")
                return None
        return None

    def _download_once(self, timeout: float, stop: threading.Event) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        with self._averager_lock:
            future = self._averager.load_state_from_peers(wait=False, timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                received = future.result(timeout=0.5)
                break
            except TimeoutError:
                if stop.is_set() or time.monotonic() > deadline:
                    future.cancel()
                    why = "stopped" if stop.is_set() else f"timed out after {timeout:.0f}s"
                    logger.warning("state download %s", why)
                    return None
            except Exception as exc:  # hivemind reports a failed download as assorted errors
                logger.warning("state download failed: %r", exc)
                return None
        if received is not None:
            self._count_state(received=_tensor_bytes(received[1]))
        return received

    def _count_state(self, sent: int = 0, received: int = 0) -> None:
        with self._state_bytes_lock:  # hivemind's thread counts what it serves, ours what we download
            self._state_bytes[0] += sent
            self._state_bytes[1] += received

    def traffic(self) -> tuple[int, int]:
        """(bytes sent, bytes received) of payloads and shared state since start."""
        return (self._exchange.bytes_sent + self._state_bytes[0], self._exchange.bytes_received + self._state_bytes[1])

    # --- rounds: the transport (DESIGN §2) ----------------------------------------------------

    def offer(self, round_: int, payload: bytes | None, tokens: float) -> None:
        """Make our encoded contribution to `round_` fetchable by its group (None: we have none)."""
        if payload is not None:
            self._exchange.offer(round_, payload, tokens)

    def gather(self, round_: int, contributing: bool, stop: threading.Event,
               among: Collection[str] | None = None, on_ready: Callable[[], None] | None = None) -> Gathered:
        """The other members' payloads for `round_`: wait until the run (or `among`, NoLoCo's drawn
        group) is ready, call `on_ready`, form the group, fetch. Safe off the main thread; `stop`
        ends the wait."""
        verdict = self.presence.wait_for_round(round_, self.settings.round_timeout, stop, among=among)
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
        others = [peer for peer in first.group if peer not in (member, self.peer_id)]
        fetched = {member: first, **self._exchange.fetch_all(others, round_, self.settings.round_timeout)}
        payloads = {peer: (item.payload, item.tokens) for peer, item in fetched.items() if item is not None}
        return Gathered("together", round_, payloads)

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
        others = [peer for peer in self._form_group(round_) if peer != self.peer_id]
        if others or not contributing:  # nobody fetches from a node that offered nothing
            return others, {}
        return self._missed_group(round_)

    def _missed_group(self, round_: int) -> tuple[list[str], dict[str, Fetched | None]]:
        """The group that averaged `round_` with us although our own matchmaking failed.

        hivemind's matchmaking can end one-sided: a leader counts us in while our request to it
        timed out (a loaded machine). The members then fetch our payload and take it into their
        mean; averaging alone would split our φ from theirs. So we ask a peer that fetched ours for
        its group and fetch the members' payloads: the same contributions, hence the same mean.
        """
        fetchers = sorted(self._exchange.served(round_, timeout=MISSED_GROUP_GRACE))
        if not fetchers:
            return [], {}
        fetched = self._exchange.fetch_all(fetchers[:1], round_, self.settings.round_timeout)
        first = fetched[fetchers[0]]
        if first is None or first.group is None or self.peer_id not in first.group:
            return [], {}
        logger.info("round=%d our matchmaking failed but %s averaged with us; joining that group",
                    round_, ", ".join(p for p in first.group if p != self.peer_id))
        return [p for p in first.group if p != self.peer_id], fetched

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

    def _form_group(self, round_: int) -> list[str]:
        """Matchmake with the peers averaging `round_`; returns their peer ids, ourselves included."""
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
            gathered = None
        group = [self.peer_id]
        for peer, info in (gathered or {}).items():
            if str(peer) == self.peer_id:
                continue
            if not (isinstance(info, dict) and info.get("round") == round_):
                logger.warning("round=%d ignored peer=%s: malformed group metadata", round_, peer)
                continue
            group.append(str(peer))
        return group

    # --- lifecycle ----------------------------------------------------------------------------

    def _may_still_fetch(self, peer: str, round_: int) -> bool:
        record = self.presence.compatible_peers().get(peer)
        return record is not None and record.may_still_fetch(round_)

    def leave(self) -> None:
        if not self._exchange.drain(self.settings.round_timeout, self._may_still_fetch):
            logger.warning("leaving before every group member fetched our last pseudo-gradient")
        self.presence.leave()
        self._exchange.close()
        self._averager.shutdown()
        self._dht.shutdown()


def _start_dht(settings: SwarmSettings) -> DHT:
    """Start hivemind's DHT; a first contact that fails is retried, since busy peers answer late."""
    attempt = 1
    while True:
        try:
            return DHT(initial_peers=list(settings.initial_peers), host_maddrs=list(settings.listen),
                       announce_maddrs=list(settings.announce) or None, start=True, startup_timeout=30,
                       record_validators=records.validators(settings.run_id),
                       identity_path=str(settings.identity) if settings.identity else None)
        except Exception as exc:  # hivemind reports p2pd and bootstrap failures as generic errors
            message = _explain_start_failure(settings, exc)
            if attempt == BOOTSTRAP_ATTEMPTS or not message.startswith("cannot reach"):
                raise SwarmError(message) from None
            logger.warning("attempt=%d %s; retrying", attempt, message)
            attempt += 1


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
