"""The composition root: it builds a node's parts and wires swarm/ and outer/ together
(docs/architecture.md §2, §7). Nothing else constructs a Swarm, an outer update or the telemetry;
startup.py builds the replica and a permissioned run's gate, and the Swarm builds its own parts
(the DHT, presence, streams, services); node.py only runs rounds with what is built here.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_node.codec import Codec, CodecConfig, codec_config_of, make_codec, max_payload_bytes
from diloco_node.config import ConfigError, NodeConfig
from diloco_node.daemon.budget import barrier_timeout
from diloco_node.daemon.checkpoint import CheckpointStore
from diloco_node.daemon.lifecycle import StopSignals
from diloco_node.outer.averaging import Averaging
from diloco_node.outer.catchup import catch_up
from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.factory import make_update
from diloco_node.outer.fragments import Fragments, split
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.outer.state import MAX_SHARED_VECTORS, OuterState
from diloco_node.outer.update import OuterUpdate, UpdateContext
from diloco_node.swarm import Swarm, SwarmSettings
from diloco_node.swarm.statesync import MAX_SERVES, CatchUp
from diloco_node.telemetry.events import Events
from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.planning import Planner
from diloco_node.telemetry.rounds import RoundReporter
from diloco_node.telemetry.server import StatusServer, announced_hosts
from diloco_node.telemetry.wire import WireMeter
from diloco_node.train import manifest
from diloco_node.train.model import build_model
from diloco_node.trust.admission import Gate
from diloco_node.trust.state import CATCH_UP_ROUNDS


@dataclass
class Parts:
    """What a node is made of. The swarm and the outer update come later (attach_swarm): they need a
    running DHT, which must start after the local ranks (start-up order, startup.py)."""

    cfg: NodeConfig
    state: OuterState  # φ: the fp32 outer copy on the CPU in the canonical layout, the same start everywhere
    codecs: list[Codec]  # one per fragment (docs/architecture.md §15): an error-feedback residual is per fragment
    runs: list[range]  # each fragment's tensor indices of φ: split() once, for the fragments and node.Drift
    phi_codec: Codec | None  # NoLoCo: how φ travels beside Δ for its consensus term
    signals: StopSignals
    telemetry: Telemetry
    server: StatusServer
    wire: WireMeter
    reporter: RoundReporter
    events: Events
    store: CheckpointStore | None
    gate: Gate
    swarm: Swarm | None = None
    update: OuterUpdate | None = None
    # how a downloaded state the run moved past is caught up to the run's (outer/catchup.py); DiLoCo only
    catch_up: CatchUp | None = None
    # set at shutdown only: a background exchange gives up (a stop request settles it instead)
    abandon: threading.Event = field(default_factory=threading.Event)


def build(cfg: NodeConfig) -> Parts:
    """Everything that needs neither a peer nor a local rank; nothing is started yet."""
    gossip = cfg.noloco.algorithm == "noloco"
    inputs = cfg.inputs
    phi = [p.detach().clone().float() for p in build_model(inputs.model, inputs.seed, inputs.init).parameters()]
    noloco = cfg.noloco
    optimizer = NoLoCoOptimizer(phi, noloco.noloco_alpha, noloco.noloco_beta, noloco.consensus_weight) if gossip \
        else OuterOptimizer(phi, cfg.outer.outer_lr, cfg.outer.outer_momentum)
    state = OuterState(phi, optimizer)
    if cfg.outer.fragments > len(phi):  # config cannot count tensors without building the model
        raise ConfigError(f"fragments {cfg.outer.fragments} is more than the model's {len(phi)} parameter tensors: "
                          "a fragment holds whole tensors")
    runs = split([p.numel() for p in phi], cfg.outer.fragments)
    # NoLoCo's consensus term needs the group's φ itself: it has no error feedback to hide
    # quantization, so it travels exactly (fp32) with codec none and as fp16 otherwise.
    phi_codec = make_codec(CodecConfig(name="none" if cfg.codec.compression == "none" else "fp16")) if gossip else None
    telemetry = Telemetry(run_id=cfg.swarm.run_id, model=inputs.model, parameters=state.numel,
                          compression=cfg.codec.compression,
                          algorithm=cfg.noloco.algorithm, label=cfg.swarm.label, parallel=cfg.local.parallel,
                          local_ranks=cfg.local.local_ranks, isolated=False, outer_step=0, inner_step=0, peers=1,
                          upload_limit_bytes_per_second=cfg.swarm.upload_rate,
                          download_limit_bytes_per_second=cfg.swarm.download_rate,
                          group_size=0, fragments=cfg.outer.fragments)
    def on_sample(sent: int, received: int) -> None:
        egress, ingress = wire.rates() or (None, None)
        telemetry.update(wire_bytes_sent=sent, wire_bytes_received=received,
                         egress_bytes_per_second=egress, ingress_bytes_per_second=ingress)

    wire = WireMeter(os.getpid(), on_sample=on_sample)
    telemetry.refresh_with(wire.refresh)
    # a joiner downloads φ and the momentum, fp32, at our upload cap shared by the transfers served at once;
    # NoLoCo's joiners take any state as it comes (nothing to catch up to): no line about serving it
    planner = Planner(cfg.swarm.upload_rate, cfg.swarm.download_rate, cfg.butterfly_from, cfg.swarm.round_timeout,
                      MAX_SHARED_VECTORS * 4 * state.numel, 0 if gossip else cfg.swarm.upload_rate / MAX_SERVES,
                      CATCH_UP_ROUNDS) \
        if cfg.swarm.upload_rate or cfg.swarm.download_rate else None
    return Parts(cfg=cfg, state=state, codecs=[make_codec(codec_config_of(cfg)) for _ in range(cfg.outer.fragments)],
                 runs=runs, phi_codec=phi_codec,
                 signals=StopSignals(), telemetry=telemetry,
                 server=StatusServer(telemetry, *cfg.swarm.status_host_port, announced_hosts(cfg.swarm.announce)),
                 wire=wire, reporter=RoundReporter(telemetry, wire, cfg.swarm.label, gossip, planner,
                                                   caps=(float(cfg.swarm.upload_rate), float(cfg.swarm.download_rate)),
                                                   batch_tokens=cfg.inputs.batch_size * cfg.inputs.seq_len),
                 events=Events(cfg.persistence.events),
                 store=CheckpointStore(cfg.checkpoint_path) if cfg.checkpoint_path else None,
                 gate=Gate(cfg.swarm.run_id))


def attach_swarm(parts: Parts, shared_state: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]) -> Swarm:
    """Join the swarm and wire the outer update to it: outer/ drives the swarm as its round.Transport."""
    cfg, gossip = parts.cfg, parts.cfg.noloco.algorithm == "noloco"
    served = manifest.served(cfg, parts.state.numel)
    signature_file = manifest.signature_path(manifest.local_path(cfg.persistence.checkpoint_dir, cfg.swarm.run_id)) \
        if cfg.persistence.checkpoint_dir else None
    settings = SwarmSettings(
        run_id=cfg.swarm.run_id, fingerprint=cfg.fingerprint(), config=cfg.fingerprint_fields(),
        initial_peers=cfg.swarm.peer, listen=cfg.swarm.listen, announce=cfg.swarm.announce,
        matchmaking_time=cfg.swarm.matchmaking_time,
        round_timeout=cfg.swarm.round_timeout,
        # NoLoCo's payload carries φ after Δ: two encoded vectors
        max_payload_bytes=(2 if gossip else 1) * max_payload_bytes(parts.state.numel),
        group_size=cfg.noloco.group_size if gossip else None, identity=cfg.persistence.identity_path, gate=parts.gate,
        butterfly_from=cfg.butterfly_from, butterfly_possible=cfg.butterfly_possible,
        reachability=cfg.averaging.reachability,
        min_group_size=cfg.averaging.min_group_size,
        upload_limit=cfg.swarm.upload_rate, download_limit=cfg.swarm.download_rate,
        barrier_timeout=barrier_timeout(cfg.round_budget, cfg.swarm.round_timeout) if cfg.round_budget else None,
        manifest=served, manifest_signature=manifest.ServedSignature(served, cfg.permission.run_owner, signature_file))
    swarm = parts.swarm = Swarm(settings, parts.state.numel, shared_state, MAX_SHARED_VECTORS)
    # our streams' rates per peer, live in /api/status and /metrics (docs/architecture.md §14, "Shown")
    parts.telemetry.refresh_with(lambda: parts.telemetry.update(**swarm.peer_rates()))
    # a joiner's state download, minutes on a slow link, in /api/status and the dashboard while it runs
    swarm.watch_downloads(lambda now: parts.telemetry.update(state_download=now))
    fragments = make_fragments(parts, swarm.peer_id)
    ctx = UpdateContext(parts.state, fragments, swarm, parts.telemetry, parts.signals.requested, parts.abandon)
    parts.update = make_update(cfg, ctx)
    if not gossip:  # NoLoCo's states differ by design: nothing to catch up to (docs/architecture.md §14)
        parts.catch_up = functools.partial(catch_up, ctx)
    return swarm


def make_fragments(parts: Parts, peer_id: str) -> Fragments:
    """The run's fragments (docs/architecture.md §15), each averaged with its own codec."""
    cfg, numels = parts.cfg, [p.numel() for p in parts.state.phi]
    averagings = [Averaging(codec, sum(numels[i] for i in run), peer_id, parts.phi_codec, cfg.averaging.aggregator,
                            cfg.averaging.max_tokens_per_round or None,
                            cfg.codec.part_align if cfg.butterfly_possible else None,
                            cfg.averaging.weighting)
                  for codec, run in zip(parts.codecs, parts.runs, strict=True)]
    return Fragments(numels, parts.runs, averagings)
