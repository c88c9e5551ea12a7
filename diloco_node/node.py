"""The round engine (DESIGN §2): start-up, one round top to bottom, shutdown.

One round: θ ← φ on the replica; H inner steps; Δ = φ − θ; the outer update (exchange, robust mean,
step on φ); eval; checkpoint. Only start-up problems end the process, and a local rank that dies
(the node then stops without saving and resumes from its last checkpoint); anything that goes
wrong inside a round is logged and the round goes on with whoever made it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from diloco_node import identity
from diloco_node.admission import AdmissionError, Gate, load_token, parse_public_key
from diloco_node.checkpoint import CheckpointStore
from diloco_node.codec import CodecConfig, make_codec
from diloco_node.config import NodeConfig
from diloco_node.lifecycle import StopSignals, isolate_forked_children
from diloco_node.outer.averaging import Averaging
from diloco_node.outer.diloco import OuterOptimizer, pseudo_gradient
from diloco_node.outer.factory import make_update
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.outer.state import MAX_SHARED_VECTORS, OuterState
from diloco_node.outer.sync import Applied
from diloco_node.outer.update import OuterUpdate, RoundReport, UpdateContext
from diloco_node.replica import Replica, ReplicaError, make_replica
from diloco_node.replica.layout import flatten
from diloco_node.startup import resume
from diloco_node.swarm.member import SwarmMember, SwarmSettings
from diloco_node.telemetry.events import Events
from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.rounds import RoundReporter, RoundTiming, round_line
from diloco_node.telemetry.server import StatusServer
from diloco_node.telemetry.wire import WireMeter
from diloco_node.train.model import build_model

logger = logging.getLogger(__name__)

# A download waits out the round the run is exchanging (blocking nodes share no state while in it).
STATE_DOWNLOAD_TIMEOUT = 60.0


class Node:
    def __init__(self, cfg: NodeConfig, say: Callable[[str], None] = print):
        self.cfg, self.say = cfg, say
        self.gossip = cfg.algorithm == "noloco"
        # φ: the fp32 outer copy on the CPU in the canonical layout, the same start on every node
        phi = [p.detach().clone().float() for p in build_model(cfg.model, cfg.seed).parameters()]
        self.state = OuterState(phi, NoLoCoOptimizer(phi, cfg.noloco_alpha, cfg.noloco_beta, cfg.consensus_weight)
                                if self.gossip else OuterOptimizer(phi, cfg.outer_lr, cfg.outer_momentum))
        self.codec = make_codec(cfg.codec_config())
        # NoLoCo's consensus term needs the group's φ itself: it has no error feedback to hide
        # quantization, so it travels exactly (fp32) with codec none and as fp16 otherwise.
        self.phi_codec = make_codec(CodecConfig(name="none" if cfg.compression == "none" else "fp16")) \
            if self.gossip else None
        self.inner_step = self.data_position = 0
        self.stream_seed = cfg.seed
        self.signals = StopSignals()
        self.stop_requested = self.signals.requested
        # Set at shutdown only: an overlapped exchange in flight when a stop is requested is settled
        # (waited for and applied), so it must not give up on the stop request itself.
        self.abandon_exchange = threading.Event()
        self.joined = False  # start-up finished: φ is the run's (or ours to start it) and worth saving
        self.failure: str | None = None  # a local rank failed: nothing of this run is saved
        self.revoked = False  # the run owner revoked our admission: we stopped
        self.gate = Gate(cfg.run_id)
        self.store = CheckpointStore(cfg.checkpoint_path) if cfg.checkpoint_path else None
        self.telemetry = Telemetry(run_id=cfg.run_id, model=cfg.model, parameters=self.state.numel,
                                   compression=cfg.compression, algorithm=cfg.algorithm, label=cfg.label,
                                   parallel=cfg.parallel, local_ranks=cfg.local_ranks, isolated=False,
                                   outer_step=0, inner_step=0, peers=1, group_size=0)
        self.server = StatusServer(self.telemetry, *cfg.status_host_port)
        self.wire = WireMeter(os.getpid(), on_sample=lambda sent, received: self.telemetry.update(
            wire_bytes_sent=sent, wire_bytes_received=received))
        self.telemetry.refresh_with(self.wire.refresh)
        self.reporter = RoundReporter(self.telemetry, self.wire, cfg.label, self.gossip)
        self.events = Events(cfg.events)
        self.replica: Replica | None = None
        self.swarm: SwarmMember | None = None
        self.update: OuterUpdate | None = None

    # --- start-up -----------------------------------------------------------------------------

    def start(self) -> None:
        """Everything that can fail because of bad input happens here, before training starts."""
        self.signals.install()  # Ctrl-C while waiting for peers is a clean stop too
        isolate_forked_children()
        if self.cfg.identity_path:
            peer_id = identity.create(self.cfg.identity_path)  # an unusable key file fails here, before anything
            if self.cfg.run_owner:
                self.gate = Gate(self.cfg.run_id, parse_public_key(self.cfg.run_owner), load_token(self.cfg.admission))
                if why := self.gate.own_refusal(peer_id):
                    raise AdmissionError(why)
        # local ranks are processes of their own: started before hivemind forks anything (ranks.py)
        self.replica = make_replica(self.cfg.replica_settings(), on_failure=self.stop_requested.set)
        outstanding = self._resume()
        self.say(f"status: {self.server.start()}")
        self.swarm = self._join_swarm()
        self.update = make_update(self.cfg, UpdateContext(
            self.state, Averaging(self.codec, self.state.numel, self.swarm.peer_id, self.phi_codec,
                                  self.cfg.aggregator, self.cfg.max_tokens_per_round or None,
                                  self.cfg.part_align if self.cfg.butterfly_possible else None), self.swarm,
            self.telemetry, self.stop_requested, self.abandon_exchange))
        self.update.restore(outstanding or [])
        if outstanding is None:  # a fresh node gets its own data order, derived from its identity
            self.stream_seed = zlib.crc32(self.swarm.peer_id.encode()) ^ self.cfg.seed
        self.swarm.presence.check_compatible()
        # A resumed checkpoint the run has moved past would only send stale work; one that still
        # holds our Δs awaiting their rounds' means (a crash under eager) lacks those means, which
        # the run's state holds exactly once. Either way the run's state replaces ours.
        if outstanding is None or outstanding or self.swarm.presence.ahead_of(self.state.round):
            self._sync_from_peers(fresh=outstanding is None)
        if self.stop_requested.is_set():
            return  # stopped during the state download: nothing of ours is worth saving
        self.swarm.presence.enter(self.state.round, self.state.digest(), self._served())  # announces us
        self.swarm.share_state()
        if self.cfg.min_peers > 1:
            self.say(f"waiting for {self.cfg.min_peers} nodes in run {self.cfg.run_id}")
            if not self.swarm.presence.wait_for_peers(self.cfg.min_peers, self.stop_requested):
                return
        self.joined = True
        self.telemetry.update(peer_id=self.swarm.peer_id, maddrs=self.swarm.visible_addresses(),
                              reachability="client" if self.swarm.client else "public",
                              eval_loss=self._evaluate(), model_digest=self.state.digest())
        snapshot = self.telemetry.snapshot()
        self.telemetry.update(eval_loss_initial=snapshot["eval_loss"])
        logger.info("joined run=%s round=%d eval_loss=%.4f parameters=%d digest=%s", self.cfg.run_id,
                    self.state.round, snapshot["eval_loss"], snapshot["parameters"], snapshot["model_digest"])
        self.events.emit("joined", run_id=self.cfg.run_id, round=self.state.round, eval_loss=snapshot["eval_loss"],
                         parameters=snapshot["parameters"], digest=snapshot["model_digest"], peer_id=self.swarm.peer_id)

    def _join_swarm(self) -> SwarmMember:
        settings = SwarmSettings(
            run_id=self.cfg.run_id, fingerprint=self.cfg.fingerprint(), config=self.cfg.fingerprint_fields(),
            initial_peers=self.cfg.peer, listen=self.cfg.listen, announce=self.cfg.announce,
            matchmaking_time=self.cfg.matchmaking_time, round_timeout=self.cfg.round_timeout,
            group_size=self.cfg.group_size if self.gossip else None, identity=self.cfg.identity_path, gate=self.gate,
            butterfly_from=self.cfg.butterfly_from, butterfly_possible=self.cfg.butterfly_possible,
            reachability=self.cfg.reachability)
        swarm = SwarmMember(settings, self.state.numel, self._shared_state, MAX_SHARED_VECTORS,
                            payload_parts=2 if self.gossip else 1)
        self.signals.install()  # again: hivemind's averager has just set SIGINT to SIG_IGN in this process
        swarm.presence.isolation.on_change = self._on_isolation
        swarm.presence.on_revoked = self._on_revoked
        self.wire.start()
        for address in swarm.visible_addresses():
            self.say(f"peer address: {address}")
        return swarm

    def _resume(self) -> list[Applied] | None:
        """Load the checkpoint, if any; None when there was none."""
        assert self.replica is not None
        resumed = resume(self.store, self.cfg.checkpoint_fingerprint(), self.state, self.replica, self.codec) \
            if self.store else None
        if resumed is None:
            return None
        self.inner_step, self.data_position, self.stream_seed = \
            resumed.inner_step, resumed.data_position, resumed.stream_seed
        self.events.emit("resumed", round=self.state.round)
        return resumed.outstanding

    def _sync_from_peers(self, fresh: bool = False) -> bool:
        """Download φ, outer momentum and the round from a peer; False when we are the first node,
        or (`fresh`: no checkpoint) the run's state is the one we built from the seed already."""
        assert self.swarm is not None and self.replica is not None
        # DiLoCo nodes serve the same state (φ under blocking, the settled copy when overlapped),
        # so the one downloaded must be the one most nodes announce; NoLoCo's φ differs by design
        received = self.swarm.download_state(STATE_DOWNLOAD_TIMEOUT + self.cfg.round_timeout,
                                            self.stop_requested, check_digest=not self.gossip,
                                            held=self._served() if fresh else None)
        if received is None:
            return False
        installed = self.state.install_shared(*received, self.cfg.fingerprint())
        if installed is None:
            logger.warning("ignored state from a peer: malformed, non-finite or from another model/config")
            return False
        if self.update is not None:
            self.update.forget()
            self.update.inherit(*installed)
        # A joiner's learning-rate schedule follows the run's progress, not its own step count.
        self.inner_step = max(self.inner_step, self.state.round * self.cfg.inner_steps)
        self.replica.advance_schedule(self.inner_step)
        logger.info("synced state from peers round=%d digest=%s", self.state.round, self.state.digest())
        self.events.emit("synced", round=self.state.round, digest=self.state.digest())
        return True

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining peer downloads (on the swarm's thread; sharing starts once `update` exists)."""
        assert self.update is not None
        assert self.swarm is not None
        return self.state.shared(self.cfg.fingerprint(), self.swarm.peer_id, self.update.served)

    # --- rounds -------------------------------------------------------------------------------

    def run(self) -> int:
        """Rounds until the run's end or a stop; 0, 1 when a local rank failed, 2 when our admission was revoked."""
        try:
            while self.joined and not self.stop_requested.is_set():
                if self.cfg.max_outer_steps and self.state.round >= self.cfg.max_outer_steps:
                    break
                self.run_round()
            if self.joined:
                self._settle()
        except ReplicaError as exc:
            self.failure = str(exc)
            logger.error("stopping: %s (this node resumes from its last checkpoint)", exc)
        finally:
            self.shutdown()
        return 1 if self.failure else 2 if self.revoked else 0

    def _settle(self) -> None:
        """At the end of a delayed or eager run, planned or asked for, apply what is in flight.

        It would otherwise be lost: delayed would never apply the last round's mean, and eager would
        keep its own pseudo-gradient in place of the group's. So a run that is resumed later finds
        no exchange to apply twice.
        """
        assert self.swarm is not None and self.update is not None
        before = self.telemetry.snapshot()
        result = self.update.settle()
        if result is None:
            return
        eval_loss = self._evaluate()
        sent, received = self.swarm.traffic()
        self.telemetry.update(eval_loss=eval_loss, model_digest=self.state.digest(), bytes_sent=sent,
                              bytes_received=received)
        # numbered like the round lines: the exchange of the round that logged round=N; sent and
        # received are what that exchange moved after the last round line
        moved = {"sent": sent - before["bytes_sent"], "received": received - before["bytes_received"]}
        logger.info("settled round=%d eval_loss=%.4f sent=%d received=%d digest=%s", self.state.round, eval_loss,
                    moved["sent"], moved["received"], self.state.digest())
        self.events.emit("settled", round=self.state.round, eval_loss=eval_loss, digest=self.state.digest(), **moved)

    def run_round(self) -> None:
        assert self.swarm is not None and self.update is not None and self.replica is not None
        self._wait_while_isolated()
        if self.stop_requested.is_set():
            return
        started = time.monotonic()
        losses = self._inner_phase()
        if losses is None or self._cut_off("after its inner phase"):
            return  # a stop mid-round: the checkpoint keeps the round's start
        computed = time.monotonic()
        self._announce(ready=True)
        delta = flatten(pseudo_gradient(self.state.phi, self.replica.theta() or []))
        tokens = float(len(losses) * self.cfg.batch_size * self.cfg.seq_len)
        report = self.update.finish_round(self.state.round, delta, tokens)
        if not report.stepped:
            self._after_skipped_round(report)
            self.swarm.share_state()
            return
        if report.diverged:  # our Δ was still a fine direction to contribute; our φ is what must be replaced
            logger.warning("round=%d our φ differs from the swarm's; re-syncing after this round", self.state.round)
            self.swarm.stop_sharing()
            self._sync_from_peers()
        self._finish_round(losses, report, RoundTiming(computed - started, time.monotonic() - computed))
        self._announce(ready=False)
        # after announcing, so our own row carries this round's stats
        self.reporter.swarm_table(self.swarm, self.replica.peak_memory())
        self.swarm.share_state()

    def _after_skipped_round(self, report: RoundReport) -> None:
        if report.verdict == "isolated":
            logger.info("round=%d dropped after its exchange: cut off from every peer, no solo step",
                        self.state.round)
        elif report.verdict == "behind":
            logger.warning("round=%d peers moved on without us; re-syncing instead of sending stale work",
                           self.state.round)
            self._sync_from_peers()
            self._announce(ready=False)

    def _inner_phase(self) -> list[float] | None:
        """θ ← φ, then H inner steps; None when a stop came first."""
        assert self.replica is not None
        with self.state.lock:
            self.replica.load(self.state.phi)
        losses = []
        for _ in range(self.cfg.inner_steps):
            if self.stop_requested.is_set():
                return None
            losses.append(self.replica.train_step(self.stream_seed, self.data_position))
            self.data_position += 1
            self.inner_step += 1
            self.telemetry.update(inner_step=self.inner_step, loss=losses[-1])
        return losses

    def _wait_while_isolated(self) -> None:
        """Pause while every peer has vanished (swarm/isolation.py): solo rounds would only take φ
        away from the swarm's. Once a peer is back, re-sync if the run went on without us."""
        assert self.swarm is not None
        if not self.swarm.presence.isolated():
            return
        while self.swarm.presence.isolated():
            if self.stop_requested.wait(1.0):
                return
        if self.swarm.presence.ahead_of(self.state.round):
            self._sync_from_peers()
            self._announce(ready=False)

    def _on_revoked(self) -> None:
        """On the heartbeat thread: the run owner revoked our admission; the others no longer deal with us."""
        logger.error("the run owner revoked this node's admission; stopping")
        self.revoked = True
        self.stop_requested.set()

    def _on_isolation(self, since: float | None) -> None:
        """On the heartbeat thread: the status says at once that we are cut off (and see only ourselves)."""
        self.telemetry.update(isolated=since is not None, isolated_since=since)
        if since is not None:
            self.telemetry.update(peers=1)

    def _cut_off(self, stage: str) -> bool:
        """Whether this round must be dropped because we are cut off from every peer; says so."""
        assert self.swarm is not None
        if not self.swarm.presence.isolated():
            return False
        logger.info("round=%d dropped %s: cut off from every peer, no solo step", self.state.round, stage)
        return True

    def _announce(self, ready: bool) -> None:
        """Tell the run where we are: training `round` (ready=False) or done with its inner phase."""
        assert self.swarm is not None
        round_ = self.state.round
        self.swarm.presence.announce(round_, round_ if ready else round_ - 1, self.state.digest(), self._served())

    def _served(self) -> tuple[int, str]:
        """The (settled round, digest) of the state we serve joiners, for our record."""
        assert self.update is not None
        served = self.state.served(self.update.served)
        return served.settled_round, served.digest()

    def _finish_round(self, losses: list[float], report: RoundReport, timing: RoundTiming) -> None:
        """Everything the round leaves behind: telemetry, the swarm table, the log line, a checkpoint.

        `report.result` is the exchange this round's outer step used: this round's when blocking,
        an earlier round's when delayed or eager (None when there was none).
        """
        assert self.swarm is not None
        assert self.replica is not None
        digest, peak_memory = self.state.digest(), self.replica.peak_memory()
        stats = self.reporter.finished(self.swarm, self.state.round, losses, self._evaluate(), report, timing, digest)
        logger.info("%s", round_line(stats, digest))
        self.events.emit("round", **stats, digest=digest, peak_memory_bytes=peak_memory)
        if self.store and self.cfg.checkpoint_every and self.state.round % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()

    def _evaluate(self) -> float:
        assert self.replica is not None
        with self.state.lock:
            self.replica.load(self.state.phi)
        return self.replica.evaluate()

    def model_digest(self) -> str:
        return self.state.digest()

    # --- persistence and shutdown -------------------------------------------------------------

    def save_checkpoint(self) -> None:
        assert self.store is not None and self.replica is not None and self.update is not None
        state = {"fingerprint": self.cfg.checkpoint_fingerprint(), **self.state.saved(),
                 "inner": self.replica.inner_state(), "codec": self.codec.state_dict(),
                 "data_position": self.data_position, "stream_seed": self.stream_seed,
                 "outstanding": [asdict(a) for a in self.update.outstanding()]}
        self.store.save(state)

    def abort(self) -> None:
        """Release what a failed start-up acquired, saving nothing."""
        self.events.close()
        if self.store:
            self.store.close()
        if self.replica:
            self.replica.close()
        if self.swarm:
            self.swarm.leave()
        self.wire.stop()
        self.server.stop()

    def shutdown(self) -> None:
        self.stop_requested.set()
        self.abandon_exchange.set()  # an exchange still waiting on peers gives up
        if self.store:
            # a node stopped before it had the run's φ has nothing worth resuming, and one whose
            # rank failed cannot gather its inner state: the last checkpoint stands
            if self.joined and not self.failure:
                self.save_checkpoint()
            self.store.close()
        if self.update:
            self.update.forget()
        if self.replica:
            self.replica.close()
        if self.swarm:
            self.swarm.leave()
        self.wire.stop()
        self.server.stop()
        logger.info("left the swarm at round=%d", self.state.round)
        self.events.emit("left", round=self.state.round, failure=self.failure)
        self.events.close()
