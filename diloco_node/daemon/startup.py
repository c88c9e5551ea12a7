"""A node's start-up, in the order it must happen: everything that can fail because of bad input
happens here, before training starts (docs/architecture.md §2).

Signals first (Ctrl-C while waiting for peers is a clean stop too); the local ranks, which are
processes of their own, before hivemind forks anything; the checkpoint; the status server; the
swarm; the run's state; then we announce ourselves and wait for the run's first peers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from diloco_node.codec import Codec
from diloco_node.daemon.checkpoint import CheckpointError, CheckpointStore, check_fits, check_node_state, installing
from diloco_node.daemon.compose import attach_swarm
from diloco_node.daemon.lifecycle import exit_later
from diloco_node.daemon.node import Node
from diloco_node.forks import isolate_forked_children
from diloco_node.outer.fragments import Drift, load_codec_state
from diloco_node.outer.state import OuterState
from diloco_node.outer.sync import Applied
from diloco_node.replica import Replica, make_replica, settings_of
from diloco_node.swarm import identity
from diloco_node.train.shares import data_stream_seed
from diloco_node.trust.admission import AdmissionError, Gate, load_token, parse_public_key

logger = logging.getLogger(__name__)

# A node whose hivemind helper died must have exited within 30 s of it (docs/architecture.md §10):
# the watchdog notices within a second, the stop path skips the swarm and saves; should a wait we
# cannot interrupt hold the main thread (hivemind's own calls), the process ends here.
HELPER_EXIT_GRACE = 20.0


@dataclass(frozen=True)
class Resumed:
    inner_step: int
    data_position: int
    stream_seed: int
    outstanding: list[Applied]  # our pseudo-gradients still awaiting their round's mean


def start(node: Node) -> None:
    """Join the run: on return `node.joined` says whether to train (a stop may have come first)."""
    try:
        _start(node)
    finally:
        node.parts.signals.starting = False  # from here on the round loop acts on stops itself


def _start(node: Node) -> None:
    parts, cfg = node.parts, node.cfg
    parts.signals.install()
    isolate_forked_children()
    if cfg.persistence.identity_path:
        peer_id = identity.create(cfg.persistence.identity_path)  # an unusable key file fails here, before anything
        if cfg.permission.run_owner:
            permission = cfg.permission
            parts.gate = Gate(cfg.swarm.run_id, parse_public_key(permission.run_owner),
                              load_token(permission.admission))
            if why := parts.gate.own_refusal(peer_id):
                raise AdmissionError(why)
    # local ranks are processes of their own: started before hivemind forks anything (ranks.py)
    node.replica = make_replica(settings_of(cfg), on_failure=node.stop_requested.set)
    parts.telemetry.update(micro_batch_size=node.replica.micro_batch())  # --micro-batch-size auto: what it found
    outstanding = _resume(node)
    node.say(f"status: {parts.server.start()}")  # its socket is closed in hivemind's forked helpers
    swarm = attach_swarm(parts, lambda: _shared_state(node))
    parts.signals.install()  # again: hivemind's averager has just set SIGINT to SIG_IGN in this process
    swarm.watch(on_isolation=lambda since: _on_isolation(node, since), on_revoked=lambda: _on_revoked(node),
                on_helper_dead=lambda why: _on_helper_dead(node, why))
    parts.wire.start()
    for address in swarm.visible_addresses():
        node.say(f"peer address: {address}")
    assert parts.update is not None
    parts.update.restore(outstanding or [])
    if outstanding is None:  # a fresh node gets its own data order, derived from its identity
        node.stream_seed = data_stream_seed(swarm.peer_id, cfg.inputs.seed)
    swarm.check_compatible()
    # A resumed checkpoint the run has moved past would only send stale work; one that still
    # holds our Δs awaiting their rounds' means (a crash under eager) lacks those means, which
    # the run's state holds exactly once. Either way the run's state replaces ours.
    if outstanding is None or outstanding or swarm.ahead_of(node.state.round):
        node.take_run_state(fresh=outstanding is None)
    if node.stop_requested.is_set():
        return  # stopped during the state download: nothing of ours is worth saving
    # where our data goes on is known now: the prefetch fills while we announce and wait for peers
    node.replica.prepare_data(node.stream_seed, node.data_position)
    swarm.enter(node.state.round, node.state.digest(), node.served())  # announces us
    swarm.share_state()
    if cfg.swarm.min_peers > 1:
        node.say(f"waiting for {cfg.swarm.min_peers} nodes in run {cfg.swarm.run_id}")
        if not swarm.wait_for_peers(cfg.swarm.min_peers, node.stop_requested):
            return
    node.joined = True
    telemetry = node.telemetry
    telemetry.update(peer_id=swarm.peer_id, maddrs=swarm.visible_addresses(),
                     reachability="client" if swarm.client else "public",
                     eval_loss=node.evaluate(), model_digest=node.state.digest())
    snapshot = telemetry.snapshot()
    telemetry.update(eval_loss_initial=snapshot["eval_loss"])
    logger.info("joined run=%s round=%d eval_loss=%.4f parameters=%d digest=%s", cfg.swarm.run_id, node.state.round,
                snapshot["eval_loss"], snapshot["parameters"], snapshot["model_digest"])
    node.events.emit("joined", run_id=cfg.swarm.run_id, round=node.state.round, eval_loss=snapshot["eval_loss"],
                     parameters=snapshot["parameters"], digest=snapshot["model_digest"], peer_id=swarm.peer_id)


def _resume(node: Node) -> list[Applied] | None:
    """Load the checkpoint, if any; None when there was none."""
    assert node.replica is not None
    store = node.parts.store
    resumed = resume(store, node.cfg.checkpoint_fingerprint(), node.state, node.replica, node.parts.codecs,
                     node.drift) if store else None
    if resumed is None:
        return None
    node.inner_step, node.data_position, node.stream_seed = \
        resumed.inner_step, resumed.data_position, resumed.stream_seed
    node.events.emit("resumed", round=node.state.round)
    return resumed.outstanding


def resume(store: CheckpointStore, fingerprint: str, state: OuterState, replica: Replica,
           codecs: list[Codec], drift: Drift) -> Resumed | None:
    """Install the checkpoint into φ's state, the replica, the codecs (one per fragment) and, with
    fragments, θ between rounds (docs/architecture.md §15); None when there is none."""
    saved = store.load()
    if saved is None:
        return None
    check_node_state(saved, store.path)  # every key read below is there and of its kind: one line if not
    if saved["fingerprint"] != fingerprint:
        raise CheckpointError(f"checkpoint in '{store.directory}' was made with another model/config: start it "
                              "with the options it was made with (defaults change between versions: "
                              "docs/running.md, upgrading)")
    check_fits(saved, store.path, [p.shape for p in state.phi])
    with installing(store.path):
        state.install(saved["round"], saved["outer_params"], saved["momentum"])
        # how far φ moved in our last rounds: a state downloaded after the resume is bounded by it (§9)
        if "reach" in saved and not state.optimizer.reach.restore(saved["reach"]):
            logger.warning("checkpoint's record of our last outer steps is damaged: the next state is taken unchecked")
        inner_step = 0
        if saved["format"] >= 2:
            replica.load_inner_state(saved["inner"])
            inner_step = int(saved["inner"]["step"])
        else:
            logger.warning("checkpoint from an older version: the inner optimizer starts afresh")
        load_codec_state(codecs, saved["codec"])
        if "drift" in saved and not drift.restore(saved["drift"], state.phi):
            logger.warning("checkpoint's θ of the fragments does not fit the model: θ restarts from φ")
        outstanding = [Applied(**entry) for entry in saved.get("outstanding", [])]
    logger.info("resumed round=%d from %s", state.round, store.path)
    return Resumed(inner_step, saved["data_position"], saved["stream_seed"], outstanding)


def _shared_state(node: Node) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What a joining peer downloads (on the swarm's thread; sharing starts once the update exists)."""
    assert node.parts.update is not None
    return node.state.shared(node.cfg.fingerprint(), node.swarm.peer_id, node.parts.update.served)


def _on_revoked(node: Node) -> None:
    """On the heartbeat thread: the run owner revoked our admission; the others no longer deal with us."""
    logger.error("the run owner revoked this node's admission; stopping")
    node.revoked = True
    node.stop_requested.set()


def _on_helper_dead(node: Node, why: str) -> None:
    """On the watchdog's thread: a helper of hivemind's died, so the swarm is gone for this process.
    `/healthz` turns unhealthy at once; the node stops (exit 1: docker and systemd restart it,
    and it resumes from its checkpoint); should the stop itself hang, it is ended within the grace."""
    logger.error("stopping: %s (exit 1: restart the node; it resumes from its last checkpoint)", why)
    node.helper_failure = why
    node.telemetry.mark_unhealthy(why)
    node.parts.abandon.set()
    node.stop_requested.set()
    exit_later(HELPER_EXIT_GRACE, 1, f"{why}; the node did not stop in {HELPER_EXIT_GRACE:.0f}s, ending it")


def _on_isolation(node: Node, since: float | None) -> None:
    """On the heartbeat thread: the status says at once that we are cut off (and see only ourselves)."""
    node.telemetry.update(isolated=since is not None, isolated_since=since)
    if since is not None:
        node.telemetry.update(peers=1)
