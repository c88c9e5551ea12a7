"""Node: assembles model, data, optimizers, swarm, telemetry and checkpoints, and runs rounds.

One round (DESIGN §2): θ ← φ; H inner AdamW steps; Δ = φ − θ; token-weighted mean of Δ over the
group; Nesterov step on φ; eval; checkpoint. Only start-up problems end the process; anything that
goes wrong inside a round is logged and the round goes on with whoever made it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diloco_node import identity
from diloco_node.checkpoint import CheckpointError, CheckpointStore
from diloco_node.codec import CodecConfig, make_codec
from diloco_node.config import NodeConfig
from diloco_node.lifecycle import StopSignals, isolate_forked_children
from diloco_node.outer.aggregate import Contribution
from diloco_node.outer.diloco import OuterOptimizer, pseudo_gradient
from diloco_node.outer.noloco import NoLoCoOptimizer, consensus_distance
from diloco_node.outer.sync import BackgroundExchange, Exchanged, overlapped_step
from diloco_node.swarm.member import AverageResult, OwnContribution, SwarmMember, SwarmSettings
from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.server import StatusServer
from diloco_node.telemetry.swarm_table import swarm_row
from diloco_node.telemetry.wire import WireMeter
from diloco_node.train.data import ByteDataset, load_corpus
from diloco_node.train.device import resolve_device
from diloco_node.train.inner import InnerConfig, InnerTrainer, evaluate
from diloco_node.train.model import build_model, count_parameters

logger = logging.getLogger(__name__)

STATE_DOWNLOAD_TIMEOUT = 60.0


@dataclass(frozen=True)
class ExchangeOutcome:
    verdict: str  # the barrier's: together, timeout, alone, behind, stopped; or lost (no exchange)
    result: AverageResult | None
    own: OwnContribution | None = None


@dataclass(frozen=True)
class RoundTiming:
    compute: float  # seconds of inner steps
    wait: float  # seconds from the end of the inner phase until the outer step (barrier + exchange)


def digest(tensors: list[torch.Tensor]) -> str:
    """Equal exactly when the tensors are bit-for-bit equal (up to hash collisions)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


class Node:
    def __init__(self, cfg: NodeConfig, say: Callable[[str], None] = print):
        self.cfg, self.say = cfg, say
        self.device = resolve_device(cfg.device)
        self.dataset = ByteDataset(load_corpus(cfg.data), cfg.seq_len)
        self.eval_batches = [(x.to(self.device), y.to(self.device))
                             for x, y in self.dataset.eval_batches(cfg.batch_size, cfg.eval_batches)]
        self.model = build_model(cfg.model, cfg.seed).to(self.device)
        self.names = [name for name, _ in self.model.named_parameters()]
        # φ: the fp32 outer copy on the CPU, in canonical (name) order, exchanged and stepped by the outer
        # optimizer; only θ lives on the accelerator.
        self.outer_params = [p.detach().cpu().clone().float() for p in self.model.parameters()]
        self.gossip = cfg.algorithm == "noloco"
        self.outer: OuterOptimizer | NoLoCoOptimizer = (
            NoLoCoOptimizer(self.outer_params, cfg.noloco_alpha, cfg.noloco_beta, cfg.consensus_weight)
            if self.gossip else OuterOptimizer(self.outer_params, cfg.outer_lr, cfg.outer_momentum))
        self.numel = sum(p.numel() for p in self.outer_params)
        self.background: BackgroundExchange[ExchangeOutcome] = BackgroundExchange(cfg.sync_timeout)
        total = cfg.max_outer_steps * cfg.inner_steps
        self.inner = InnerTrainer(self.model, InnerConfig(
            lr=cfg.inner_lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
            total_steps=total, grad_clip=cfg.grad_clip))
        self.codec = make_codec(cfg.codec_config())
        # NoLoCo's consensus term needs the group's φ itself: it has no error feedback to hide
        # quantization, so it travels exactly (fp32) with codec none and as fp16 otherwise.
        self.phi_codec = make_codec(CodecConfig(name="none" if cfg.compression == "none" else "fp16")) \
            if self.gossip else None
        self.round = 0
        self.compute_seconds = self.wait_seconds = 0.0  # since start, for utilization
        self.data_position = 0
        self.stream_seed = cfg.seed
        self.lock = threading.Lock()  # guards φ, outer state and round against state-sharing reads
        self.signals = StopSignals()
        self.stop_requested = self.signals.requested
        # Set at shutdown only: an overlapped exchange in flight when a stop is requested is settled
        # (waited for and applied), so it must not give up on the stop request itself.
        self.abandon_exchange = threading.Event()
        self.joined = False  # start-up finished: φ is the run's (or ours to start it) and worth saving
        self.store = CheckpointStore(cfg.checkpoint_path) if cfg.checkpoint_path else None
        self.telemetry = Telemetry(run_id=cfg.run_id, model=cfg.model, parameters=count_parameters(self.model),
                                   compression=cfg.compression, algorithm=cfg.algorithm, label=cfg.label,
                                   isolated=False, outer_step=0, inner_step=0, peers=1, group_size=0)
        self.server = StatusServer(self.telemetry, *cfg.status_host_port)
        self.wire_at_last_round = (0, 0)
        self.wire = WireMeter(os.getpid(), on_sample=lambda sent, received: self.telemetry.update(
            wire_bytes_sent=sent, wire_bytes_received=received))
        self.telemetry.refresh_with(self.wire.refresh)
        self.swarm: SwarmMember | None = None

    # --- start-up -----------------------------------------------------------------------------

    def start(self) -> None:
        """Everything that can fail because of bad input happens here, before training starts."""
        self.signals.install()  # Ctrl-C while waiting for peers is a clean stop too
        isolate_forked_children()
        if self.cfg.identity_path:
            identity.create(self.cfg.identity_path)  # an unusable key file fails here, before anything starts
        resumed = self._resume()
        self.say(f"status: {self.server.start()}")
        settings = SwarmSettings(
            run_id=self.cfg.run_id, fingerprint=self.cfg.fingerprint(), config=self.cfg.fingerprint_fields(),
            initial_peers=self.cfg.peer, listen=self.cfg.listen, announce=self.cfg.announce,
            matchmaking_time=self.cfg.matchmaking_time, round_timeout=self.cfg.round_timeout,
            group_size=self.cfg.group_size if self.gossip else None, identity=self.cfg.identity_path)
        self.swarm = SwarmMember(settings, self.outer_params, self._shared_state, self.codec, self.phi_codec)
        self.signals.install()  # again: hivemind's averager has just set SIGINT to SIG_IGN in this process
        self.swarm.presence.isolation.on_change = self._on_isolation
        self.wire.start()
        for address in self.swarm.visible_addresses():
            self.say(f"peer address: {address}")
        if not resumed:  # a fresh node gets its own data order, derived from its identity
            self.stream_seed = zlib.crc32(self.swarm.peer_id.encode()) ^ self.cfg.seed
        self.swarm.presence.enter(self.round, self.model_digest())
        if not resumed or self.swarm.presence.ahead_of(self.round):
            # a resumed checkpoint the run has moved past would only send stale work: re-sync
            self._sync_from_peers()
        if self.stop_requested.is_set():
            return  # stopped during the state download: nothing of ours is worth saving
        self._announce(ready=False)
        self.swarm.share_state(self.round)
        if self.cfg.min_peers > 1:
            self.say(f"waiting for {self.cfg.min_peers} nodes in run {self.cfg.run_id}")
            if not self.swarm.presence.wait_for_peers(self.cfg.min_peers, self.stop_requested):
                return
        self.joined = True
        self.telemetry.update(peer_id=self.swarm.peer_id, maddrs=self.swarm.visible_addresses(),
                              eval_loss=self._evaluate(), model_digest=self.model_digest())
        snapshot = self.telemetry.snapshot()
        self.telemetry.update(eval_loss_initial=snapshot["eval_loss"])
        logger.info("joined run=%s round=%d eval_loss=%.4f parameters=%d digest=%s", self.cfg.run_id, self.round,
                    snapshot["eval_loss"], snapshot["parameters"], snapshot["model_digest"])

    def _resume(self) -> bool:
        state = self.store.load() if self.store else None
        if state is None:
            return False
        if state["fingerprint"] != self.cfg.fingerprint():
            raise CheckpointError(f"checkpoint in '{self.cfg.checkpoint_path}' was made with another model/config")
        self._install_outer(state["round"], state["outer_params"], state["momentum"])
        self.inner.load_state_dict(state["inner"])
        self.codec.load_state_dict(state["codec"])
        self.data_position, self.stream_seed = state["data_position"], state["stream_seed"]
        logger.info("resumed round=%d from %s", self.round, self.store.path if self.store else "")
        return True

    def _sync_from_peers(self) -> bool:
        """Download φ, outer momentum and the round from a peer; False when we are the first node."""
        assert self.swarm is not None
        received = self.swarm.download_state(STATE_DOWNLOAD_TIMEOUT, self.stop_requested)
        if received is None:
            return False
        metadata, tensors = received
        n = len(self.outer_params)
        shapes_match = len(tensors) == 2 * n and all(
            t.shape == p.shape for t, p in zip(tensors, self.outer_params + self.outer_params, strict=True))
        well_formed = (isinstance(metadata, dict) and isinstance(metadata.get("round"), int)
                       and metadata["round"] >= 0 and metadata.get("fingerprint") == self.cfg.fingerprint())
        if not (well_formed and shapes_match and all(torch.isfinite(t).all() for t in tensors)):
            logger.warning("ignored state from a peer: malformed, non-finite or from another model/config")
            return False
        momentum = tensors[n:] if metadata.get("has_momentum") else None
        self._install_outer(int(metadata["round"]), tensors[:n], momentum)
        # A joiner's learning-rate schedule follows the run's progress, not its own step count.
        self.inner.step = max(self.inner.step, self.round * self.cfg.inner_steps)
        logger.info("synced state from peers round=%d digest=%s", self.round, self.model_digest())
        return True

    def _install_outer(self, round_: int, params: list[torch.Tensor], momentum: list[torch.Tensor] | None) -> None:
        with self.lock:
            for phi, value in zip(self.outer_params, params, strict=True):
                phi.copy_(value)
            self.outer.load_momentum(momentum)
            self.round = round_

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining peer downloads; called on hivemind's thread, hence the lock and the copies."""
        with self.lock:
            metadata = {"round": self.round, "fingerprint": self.cfg.fingerprint(),
                        "has_momentum": self.outer.has_momentum()}
            tensors = [p.clone() for p in self.outer_params] + [m.clone() for m in self.outer.momentum_buffers()]
        return metadata, tensors

    # --- rounds -------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self.joined and not self.stop_requested.is_set():
                if self.cfg.max_outer_steps and self.round >= self.cfg.max_outer_steps:
                    break
                self.run_round()
            self._settle_last_exchange()
        finally:
            self.shutdown()

    def _settle_last_exchange(self) -> None:
        """At the end of a delayed or eager run, planned or asked for, apply the last round's exchange.

        It would otherwise be lost: delayed would never apply the last round's mean, and eager would
        keep its own pseudo-gradient in place of the group's. This is the step the next round would
        take with nothing new trained, so every pseudo-gradient ends up applied exactly once, and a
        run that is resumed later finds no exchange to apply twice.
        """
        pending = self.background.pending_round()
        if pending is None:
            return
        outcome = self.background.collect(pending)
        if outcome is None or outcome.result is None:
            logger.warning("round=%d the last exchange did not finish; ending without it", self.round)
            return
        step = self._overlapped_step(outcome, torch.zeros(self.numel))
        if step is None or isinstance(self.outer, NoLoCoOptimizer):
            return
        with self.lock:
            self.outer.step(self._unflatten(step))
        eval_loss = self._evaluate()
        assert self.swarm is not None
        before = self.telemetry.snapshot()
        sent, received = self.swarm.traffic()
        self.telemetry.update(eval_loss=eval_loss, model_digest=self.model_digest(), bytes_sent=sent,
                              bytes_received=received)
        # numbered like the round lines: the exchange of the round that logged round=N; sent and
        # received are what that exchange moved after the last round line
        logger.info("settled round=%d eval_loss=%.4f sent=%d received=%d digest=%s", self.round, eval_loss,
                    sent - before["bytes_sent"], received - before["bytes_received"], self.model_digest())

    def run_round(self) -> None:
        assert self.swarm is not None
        self._wait_while_isolated()
        if self.stop_requested.is_set():
            return
        started = time.monotonic()
        self._load_outer_into_model()
        losses = self._inner_phase()
        if losses is None:
            return  # stop requested mid-round: the checkpoint keeps the round's start
        if self._cut_off("after its inner phase"):
            return
        computed = time.monotonic()
        tokens = float(len(losses) * self.cfg.batch_size * self.cfg.seq_len)
        self._announce(ready=True)
        delta = torch.cat([d.reshape(-1) for d in pseudo_gradient(
            self.outer_params, [p.detach().cpu() for p in self.model.parameters()])])
        own = self.swarm.contribute(delta, self.round, tokens, self._flat_phi() if self.gossip else None)
        if self.gossip:
            outcome = self._gossip(self.round, own, tokens)
            step = outcome.result.mean if outcome.result else None
        elif self.cfg.sync == "blocking":
            outcome = self._exchange(self.round, own, tokens, self.stop_requested)
            step = outcome.result.mean if outcome.result else None
        else:
            outcome = self.background.collect(self.round - 1) or ExchangeOutcome("lost", None)
            self.background.start(self.round, functools.partial(self._exchange, self.round, own, tokens,
                                                                self.abandon_exchange))
            step = self._overlapped_step(outcome, own.decoded if own.decoded is not None else torch.zeros(self.numel))
        if outcome.verdict == "stopped":
            return
        if outcome.result is not None and len(outcome.result.group) <= 1 and self._cut_off("after its exchange"):
            return
        if outcome.verdict == "behind":
            logger.warning("round=%d peers moved on without us; re-syncing instead of sending stale work",
                           self.round)
            self._sync_from_peers()
            self._announce(ready=False)
            return
        diverged = (not self.gossip and self.cfg.sync == "blocking"
                    and self.swarm.presence.diverged(self.round, self.model_digest()))
        if diverged:  # our Δ was still a fine direction to contribute; our φ is what must be replaced
            logger.warning("round=%d our φ differs from the swarm's; re-syncing after this round", self.round)
            self.swarm.stop_sharing()
        exchanged = time.monotonic()
        with self.lock:
            if isinstance(self.outer, NoLoCoOptimizer):
                distance = None  # none when this round took no step
                if step is not None and outcome.result and outcome.result.mean_phi is not None:
                    mean_phi = outcome.result.mean_phi
                    distance = consensus_distance(self._flat_phi(), mean_phi)
                    self.outer.step(self._unflatten(step), self._unflatten(mean_phi))
                self.telemetry.update(consensus_distance=distance)
            elif step is not None:
                self.outer.step(self._unflatten(step))
            self.round += 1
        if self.cfg.sync == "blocking":
            # only now: a joiner that sees this round exchanged must also find φ past it
            self.swarm.presence.mark_exchanged(self.round - 1)
        if diverged:
            self._sync_from_peers()
        self._finish_round(losses, outcome.result, own, RoundTiming(computed - started, exchanged - computed))
        self._announce(ready=False)
        self._refresh_swarm_table()  # after announcing, so our own row carries this round's stats
        self.swarm.share_state(self.round)

    def _wait_while_isolated(self) -> None:
        """Pause while every peer has vanished (swarm/isolation.py): solo rounds would only take φ
        away from the swarm's. Once a peer is back, re-sync if the run went on without us."""
        assert self.swarm is not None
        if not self.swarm.presence.isolated():
            return
        while self.swarm.presence.isolated():
            if self.stop_requested.wait(1.0):
                return
        if self.swarm.presence.ahead_of(self.round):
            self._sync_from_peers()
            self._announce(ready=False)

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
        logger.info("round=%d dropped %s: cut off from every peer, no solo step", self.round, stage)
        return True

    def _gossip(self, round_: int, own: OwnContribution, tokens: float) -> ExchangeOutcome:
        """NoLoCo: wait (bounded) for our small drawn group only, then average with it."""
        assert self.swarm is not None
        # Gossip tolerates a round of lag (we then meet nobody, or whoever is as late); a node that
        # everyone else has left two rounds behind re-syncs instead.
        if self.swarm.presence.all_past(round_ + 1):
            return ExchangeOutcome("behind", None)
        others = [peer for peer in self.swarm.drawn_group(round_) if peer != self.swarm.peer_id]
        if not others:  # the odd one out this round: nobody to wait for
            logger.info("round=%d drawn to average alone", round_)
            return ExchangeOutcome("alone", self._average_alone(own, tokens), own)
        with self._exchanging(round_):
            verdict = self.swarm.presence.wait_for_round(round_, self.cfg.round_timeout, self.stop_requested,
                                                         among=others)
            if verdict == "stopped":
                return ExchangeOutcome("stopped", None)
            if verdict in ("alone", "behind"):
                logger.info("round=%d our group has left or moved on; averaging alone", round_)
                return ExchangeOutcome("alone", self._average_alone(own, tokens), own)
            result = self.swarm.average(own, tokens, round_)
        return ExchangeOutcome("together" if len(result.group) > 1 else "alone", result, own)

    def _average_alone(self, own: OwnContribution, tokens: float) -> AverageResult:
        assert self.swarm is not None
        contributions = [Contribution(self.swarm.peer_id, tokens, own.decoded)] if own.decoded is not None else []
        return self.swarm.result_of(contributions, own, tokens, own.codec_seconds)

    @contextlib.contextmanager
    def _exchanging(self, round_: int) -> Iterator[None]:
        """`exchanging_round` in the status while this exchange runs. An abandoned exchange that
        ends late leaves the newer one's value alone."""
        self.telemetry.update(exchanging_round=round_)
        try:
            yield
        finally:
            self.telemetry.clear_if("exchanging_round", round_)

    def _flat_phi(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.outer_params])

    def _exchange(self, round_: int, own: OwnContribution, tokens: float, stop: threading.Event) -> ExchangeOutcome:
        """Barrier, then the group's mean; on the main thread (blocking) or the exchange thread.
        `stop` set makes the barrier give up."""
        with self._exchanging(round_):
            return self._exchange_now(round_, own, tokens, stop)

    def _exchange_now(self, round_: int, own: OwnContribution, tokens: float,
                      stop: threading.Event) -> ExchangeOutcome:
        assert self.swarm is not None
        verdict = self.swarm.presence.wait_for_round(round_, self.cfg.round_timeout, stop)
        if verdict in ("stopped", "behind"):
            return ExchangeOutcome(verdict, None)
        if verdict == "alone":
            result = self._average_alone(own, tokens)
        else:
            result = self.swarm.average(own, tokens, round_)
            if len(result.group) <= 1:
                logger.warning("round=%d no peer averaged with us; applying our own pseudo-gradient", round_)
        if self.cfg.sync != "blocking":  # blocking marks it once φ has taken the step (see run_round)
            self.swarm.presence.mark_exchanged(round_)
        return ExchangeOutcome(verdict, result, own)

    def _overlapped_step(self, previous: ExchangeOutcome, fresh: torch.Tensor) -> torch.Tensor | None:
        """What delayed / eager apply now, given the previous round's exchange and our fresh Δ."""
        finished = None
        if previous.result is not None and previous.own is not None:
            # A round whose own Δ could not be sent (non-finite) applied zeros as its own part; the
            # others' mean of it must still be applied (it used to be dropped).
            own = previous.own.decoded if previous.own.decoded is not None else torch.zeros(self.numel)
            finished = Exchanged(self.round - 1, previous.result.mean, own, previous.result.own_share)
        assert self.swarm is not None
        return overlapped_step(self.cfg.sync, finished, fresh, len(self.swarm.presence.compatible_peers()) or 1,
                               self.cfg.eager_proxy)

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in self.outer_params]),
                                                       self.outer_params, strict=True)]

    def _announce(self, ready: bool) -> None:
        """Tell the run where we are: training `round` (ready=False) or done with its inner phase."""
        assert self.swarm is not None
        self.swarm.presence.announce(self.round, self.round if ready else self.round - 1, self.model_digest())

    def _inner_phase(self) -> list[float] | None:
        losses = []
        for _ in range(self.cfg.inner_steps):
            if self.stop_requested.is_set():
                return None
            x, y = self.dataset.train_batch(self.cfg.batch_size, self.stream_seed, self.data_position)
            self.data_position += 1
            losses.append(self.inner.train_step(x.to(self.device), y.to(self.device)))
            self.telemetry.update(inner_step=self.inner.step, loss=losses[-1])
        return losses

    def _finish_round(self, losses: list[float], result: AverageResult | None, own: OwnContribution,
                      timing: RoundTiming) -> None:
        """Everything the round leaves behind: telemetry, the swarm table, the log line, a checkpoint.

        `result` is the exchange this round's outer step used: this round's when blocking, the
        previous round's when delayed or eager (None when there was none).
        """
        assert self.swarm is not None
        group = result.group if result else ()
        codec_seconds = result.codec_seconds if result else own.codec_seconds
        before = self.telemetry.snapshot()
        sent, received = self.swarm.traffic()
        wire = self._wire_this_round()
        self.compute_seconds += timing.compute
        self.wait_seconds += timing.wait
        numel, payload = before["parameters"], own.payload_bytes
        raw = 4 * numel * (2 if self.gossip else 1)  # fp32 size of what we sent: NoLoCo sends Δ and φ
        stats = {
            "round": self.round, "time": time.time(), "loss": sum(losses) / len(losses),
            "eval_loss": self._evaluate(), "group_size": len(group),
            "bytes_sent": sent - before["bytes_sent"], "bytes_received": received - before["bytes_received"],
            "bytes_sent_total": sent, "bytes_received_total": received, **wire, "payload_bytes": payload,
            "raw_bytes": raw, "compression_ratio": raw / payload if payload else None,
            "bytes_per_param": payload / numel, "codec_seconds": round(codec_seconds, 4),
            "transfer_seconds": round(result.transfer_seconds, 3) if result else None,
            "transfer_bytes": result.received_bytes if result else None,
            "compute_seconds": round(timing.compute, 3), "wait_seconds": round(timing.wait, 3),
            "utilization": timing.compute / (timing.compute + timing.wait),
            "round_seconds": round(timing.compute + timing.wait, 3)}
        if self.gossip:
            stats.update(group=list(group), consensus_distance=before.get("consensus_distance"))
        self.telemetry.record_round(stats)
        utilization = self.compute_seconds / (self.compute_seconds + self.wait_seconds)
        self.telemetry.update(
            outer_step=self.round, loss=stats["loss"], eval_loss=stats["eval_loss"], group_size=len(group),
            group=list(group), model_digest=self.model_digest(), bytes_sent=sent, bytes_received=received,
            last_round_bytes_sent=stats["bytes_sent"], last_round_bytes_received=stats["bytes_received"],
            round_seconds=stats["round_seconds"], payload_bytes=payload, raw_bytes=stats["raw_bytes"],
            bytes_per_param=stats["bytes_per_param"], compression_ratio=stats["compression_ratio"],
            codec_seconds=stats["codec_seconds"], compute_seconds=round(self.compute_seconds, 3),
            wait_seconds=round(self.wait_seconds, 3), utilization=utilization)
        self.swarm.presence.publish_stats(
            label=self.cfg.label, rounds=self.round, bytes_sent=sent, bytes_received=received,
            last_round_bytes_sent=stats["bytes_sent"], last_round_bytes_received=stats["bytes_received"],
            wire_bytes_sent=wire.get("wire_sent_total"), wire_bytes_received=wire.get("wire_received_total"),
            last_exchange_seconds=round(timing.wait, 3), utilization=utilization, time=stats["time"])
        logger.info("round=%d loss=%.4f eval_loss=%.4f group_size=%d sent=%d received=%d seconds=%.1f "
                    "payload=%d bytes_per_param=%.4f codec_seconds=%.3f utilization=%.3f transfer=%d/%.3fs "
                    "digest=%s%s", self.round, stats["loss"], stats["eval_loss"], len(group), stats["bytes_sent"],
                    stats["bytes_received"], stats["round_seconds"], payload, stats["bytes_per_param"],
                    codec_seconds, stats["utilization"], stats["transfer_bytes"] or 0,
                    stats["transfer_seconds"] or 0.0, self.model_digest(), self._gossip_summary(stats))
        if self.store and self.cfg.checkpoint_every and self.round % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()

    @staticmethod
    def _gossip_summary(stats: dict[str, Any]) -> str:
        """NoLoCo's part of the round line: how far φ was from the group's, and who the group was."""
        if "group" not in stats:
            return ""
        distance = stats["consensus_distance"]
        return (f" consensus_distance={'-' if distance is None else f'{distance:.3e}'}"
                f" group={','.join(stats['group']) or '-'}")

    def _wire_this_round(self) -> dict[str, int]:
        """This round's and the cumulative link-layer bytes (see telemetry/wire.py); {} if unmeasured."""
        self.wire.refresh(max_age=0)
        totals = self.wire.totals()
        if totals is None:
            return {}
        (sent, received), (last_sent, last_received) = totals, self.wire_at_last_round
        self.wire_at_last_round = totals
        return {"wire_sent": sent - last_sent, "wire_received": received - last_received,
                "wire_sent_total": sent, "wire_received_total": received}

    def _refresh_swarm_table(self) -> None:
        assert self.swarm is not None
        peers = self.swarm.presence.compatible_peers()
        self.telemetry.update(peers=len(peers))
        self.telemetry.set_peers([swarm_row(record, record.peer_id == self.swarm.peer_id)
                                  for record in peers.values()])

    def _load_outer_into_model(self) -> None:
        with torch.no_grad(), self.lock:
            for theta, phi in zip(self.model.parameters(), self.outer_params, strict=True):
                theta.copy_(phi)

    def _evaluate(self) -> float:
        self._load_outer_into_model()
        return evaluate(self.model, self.eval_batches)

    def model_digest(self) -> str:
        with self.lock:
            return digest(self.outer_params)

    # --- persistence and shutdown -------------------------------------------------------------

    def save_checkpoint(self) -> None:
        assert self.store is not None
        with self.lock:
            state = {"fingerprint": self.cfg.fingerprint(), "round": self.round,
                     "outer_params": [p.clone() for p in self.outer_params],
                     "momentum": self.outer.momentum_buffers() if self.outer.has_momentum() else None,
                     "inner": self.inner.state_dict(), "codec": self.codec.state_dict(),
                     "data_position": self.data_position,
                     "stream_seed": self.stream_seed, "digest": digest(self.outer_params)}
        self.store.save(state)

    def abort(self) -> None:
        """Release what a failed start-up acquired, saving nothing."""
        self.background.close()
        if self.store:
            self.store.close()
        if self.swarm:
            self.swarm.leave()
        self.wire.stop()
        self.server.stop()

    def shutdown(self) -> None:
        self.stop_requested.set()
        self.abandon_exchange.set()  # an exchange still waiting on peers gives up
        self.background.close()
        if self.store:
            if self.joined:  # a node stopped before it had the run's φ has nothing worth resuming
                self.save_checkpoint()
            self.store.close()
        if self.swarm:
            self.swarm.leave()
        self.wire.stop()
        self.server.stop()
        logger.info("left the swarm at round=%d", self.round)
