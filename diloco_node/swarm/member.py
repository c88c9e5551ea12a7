"""This node's membership in the swarm: the DHT, the presence heartbeat, the round barrier,
pseudo-gradient averaging and state sharing. The rest of the package never sees hivemind.

Averaging uses hivemind's DecentralizedAverager: DHT matchmaking, a butterfly all-reduce that
splits the work evenly across the group, token weights, timeouts and retries are exactly what a
DiLoCo outer step needs, and its state download gives late joiners φ and the outer state.
Rounds never mix: the averager's group key carries the round number, so only peers averaging the
same round can meet, and the run id + config fingerprint are part of the averager's prefix.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time

from diloco_node.swarm import records
from diloco_node.swarm.metering import MeteredCompression, butterfly_traffic
from diloco_node.swarm.records import NodeRecord

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 3.0
ROUND_BITS = 24  # group key bits carrying the round number (mod 2**24)

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


@dataclass(frozen=True)
class AverageResult:
    group_size: int
    group: tuple[str, ...]
    bytes_sent: int
    bytes_received: int


class _StateSharingAverager(DecentralizedAverager):
    """get_current_state is hivemind's documented hook for what a joining peer downloads."""

    state_provider: StateProvider | None = None

    def get_current_state(self):  # type: ignore[override]  # runs in our process, on hivemind's thread
        metadata, tensors = self.state_provider() if self.state_provider else ({}, [])
        return metadata, tensors, None


class SwarmMember:
    def __init__(self, settings: SwarmSettings, template: Sequence[torch.Tensor], state_provider: StateProvider):
        self.settings = settings
        self._dht = _start_dht(settings)
        self._dht_lock = threading.Lock()  # hivemind's DHT pipe is not safe to share between threads
        self.peer_id = str(self._dht.peer_id)
        self._numel = sum(t.numel() for t in template)
        self._metered = MeteredCompression()
        self._averager = _StateSharingAverager(
            [torch.zeros_like(t, dtype=torch.float32) for t in template], self._dht, start=True,
            prefix=f"{settings.run_id}_{settings.fingerprint}", min_matchmaking_time=settings.matchmaking_time,
            request_timeout=min(3.0, settings.matchmaking_time / 2), next_chunk_timeout=10.0,
            allreduce_timeout=settings.round_timeout, compression=self._metered, allow_state_sharing=False)
        self._averager.state_provider = state_provider
        self._record = NodeRecord(self.peer_id, settings.fingerprint, settings.config, 0, -1)
        self._refused: set[str] = set()
        self._live: dict[str, NodeRecord] = {}
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="swarm-heartbeat", daemon=True)

    # --- membership -------------------------------------------------------------------------

    def visible_addresses(self) -> list[str]:
        return [str(addr) for addr in self._dht.get_visible_maddrs()]

    def enter(self, round_: int) -> None:
        """Announce ourselves and refuse to go on if the run already uses another config."""
        self.announce(round_, ready_round=round_ - 1)
        for record in self._fetch().values():
            if record.fingerprint != self.settings.fingerprint:
                difference = records.config_difference(self.settings.config, record.config)
                raise SwarmError(f"refused: run '{self.settings.run_id}' uses an incompatible config "
                                 f"(peer {record.peer_id}: {difference})")
        self._heartbeat.start()

    def announce(self, round_: int, ready_round: int) -> None:
        self._record = NodeRecord(self.peer_id, self.settings.fingerprint, self.settings.config, round_, ready_round)
        with self._dht_lock:
            records.publish(self._dht, self.settings.run_id, self._record)

    def compatible_peers(self) -> dict[str, NodeRecord]:
        """Live nodes of this run with our config, ourselves included (as of the last heartbeat)."""
        return dict(self._live)

    def share_state(self, round_: int) -> None:
        """Let others download our state; a higher round makes us the preferred source."""
        self._averager.state_sharing_priority = float(round_)
        self._averager.allow_state_sharing = True

    def download_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        if len(self._fetch()) <= 1:
            return None  # nobody else is here: we start the run
        return self._averager.load_state_from_peers(timeout=timeout)

    # --- rounds -------------------------------------------------------------------------------

    def wait_for_round(self, round_: int, timeout: float) -> str:
        """Wait until every live compatible peer has finished its inner phase of `round_`.

        Returns "together" (everyone is ready), "timeout" (go on with those that are),
        "alone" (nobody else is in the run) or "behind" (others already finished this round).
        """
        deadline = time.monotonic() + timeout
        while True:
            others = {p: r for p, r in self._fetch().items()
                      if p != self.peer_id and r.fingerprint == self.settings.fingerprint}
            if any(r.round > round_ for r in others.values()):
                return "behind"  # they already averaged this round without us
            if not others:
                return "alone"
            if all(r.ready_round >= round_ for r in others.values()):
                return "together"
            if time.monotonic() > deadline:
                waiting = sorted(p for p, r in others.items() if r.ready_round < round_)
                logger.warning("round=%d barrier timed out; not waiting for %s", round_, ", ".join(waiting))
                return "timeout"
            time.sleep(0.3)

    def average(self, tensors: Sequence[torch.Tensor], weight: float, round_: int) -> AverageResult:
        """Replace `tensors` in place by the weighted mean over the group that forms for this round."""
        self._averager.set_group_bits(format(round_ % 2**ROUND_BITS, f"0{ROUND_BITS}b"))
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
        sent_before, elements_before = self._metered.snapshot()
        try:
            gathered = self._averager.step(
                weight=weight, gather={"round": round_}, timeout=self.settings.round_timeout,
                scheduled_time=get_dht_time() + self.settings.matchmaking_time)
        except Exception as exc:  # hivemind surfaces timeouts and peer failures as assorted types
            logger.warning("round=%d averaging failed (%s); going on alone", round_, type(exc).__name__)
            gathered = None
        if not gathered:
            return AverageResult(1, (self.peer_id,), 0, 0)
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                tensor.copy_(buffer)
        sent_after, elements_after = self._metered.snapshot()
        traffic = butterfly_traffic(sent_after - sent_before, elements_after - elements_before,
                                    self._numel, len(gathered))
        group = tuple(sorted(str(peer) for peer in gathered))
        return AverageResult(len(group), group, traffic.bytes_sent, traffic.bytes_received)

    # --- lifecycle ----------------------------------------------------------------------------

    def leave(self) -> None:
        self._stop.set()
        try:
            with self._dht_lock:
                records.withdraw(self._dht, self.settings.run_id, self._record)
        except Exception as exc:  # leaving must never fail; the record expires on its own anyway
            logger.debug("withdraw failed: %r", exc)
        self._averager.shutdown()
        self._dht.shutdown()

    def _fetch(self) -> dict[str, records.NodeRecord]:
        with self._dht_lock:
            found = records.fetch(self._dht, self.settings.run_id)
        self._live = {p: r for p, r in found.items() if r.fingerprint == self.settings.fingerprint}
        self._live.setdefault(self.peer_id, self._record)
        for peer, record in found.items():
            if record.fingerprint != self.settings.fingerprint and peer not in self._refused:
                self._refused.add(peer)
                difference = records.config_difference(self.settings.config, record.config)
                logger.warning("refused peer %s: incompatible config (%s)", peer, difference)
        return found

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                with self._dht_lock:
                    records.publish(self._dht, self.settings.run_id, self._record)
                self._fetch()
            except Exception as exc:  # a missed heartbeat is retried; the loop must outlive it
                logger.warning("heartbeat failed: %r", exc)


def _start_dht(settings: SwarmSettings) -> DHT:
    try:
        return DHT(initial_peers=list(settings.initial_peers), host_maddrs=list(settings.listen),
                   announce_maddrs=list(settings.announce) or None, start=True, startup_timeout=30)
    except Exception as exc:  # hivemind reports p2pd and bootstrap failures as generic errors
        raise SwarmError(_explain_start_failure(settings, exc)) from None


def _explain_start_failure(settings: SwarmSettings, exc: Exception) -> str:
    text = str(exc)
    if "address already in use" in text.lower():
        return f"cannot listen on {', '.join(settings.listen)}: address already in use"
    if settings.initial_peers and ("bootstrap" in text.lower() or "connect" in text.lower()):
        return f"cannot reach any peer ({', '.join(settings.initial_peers)}): {text.splitlines()[0]}"
    return f"cannot start the swarm node: {text.splitlines()[0] if text else type(exc).__name__}"
