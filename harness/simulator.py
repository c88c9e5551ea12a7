"""The learning simulator (docs/architecture.md §16): M workers in one process, each a real node's
learning path, joined by an in-memory transport instead of the swarm.

What is real: each worker is the node's own parts from `compose.build` (φ, the outer optimizer, the
codecs with their error feedback, one `Averaging` per fragment from `compose.make_fragments`), its
own `SingleReplica` (the node's inner AdamW, schedule and data stream), `Drift`, and the outer
update `outer.factory.make_update` picks for its config (blocking, delayed, eager, NoLoCo). A round
is the one `node.Node.run_round` runs: θ ← φ, `round_inner_steps` inner steps on the worker's stream
(`data_stream_seed`), Δ = φ − θ, `finish_round`. So a change in outer/, codec/ or train/ changes the
simulator's result; tests/integration/test_simulator.py checks its φ digests against real nodes'.

What is not: the swarm. `MemoryTransport` implements round.Transport over a shared `Room`: every
worker of a group gets every other member's payload of a round once all of them have offered it
(no timeouts, nobody leaves, no butterfly: the all-gather's arithmetic). Workers run their inner
phases one after another on one thread, then finish the round each on a thread of its own, since a
blocking `gather` waits for the others' offers.

Nodes of different speeds (`simulate(speeds=…, spent=…)`, docs/architecture.md §13): a worker s× as
fast as the slowest spends its speed as `--speed-spent` would, at equal wall-clock (rounds): `steps`,
s·H inner steps a round (its cosine over its own steps, its warmup by its own steps: the node's
progress-indexed decay and warmup at the fastest's pace are not reproduced), or `batch`, H steps of s
batches each (the replica's own accumulation, the fixed-H schedule the node uses under batch).

`ddp` and `alone` train the same model, data streams and schedule through the same replica class:
DDP steps one replica on the concatenation of the M workers' batches of each position (the mean of M
equal-size batch means is the mean over their union, so this is gradient averaging every step).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_node.config import NodeConfig
from diloco_node.daemon.compose import build, make_fragments
from diloco_node.outer.factory import make_update
from diloco_node.outer.fragments import Drift
from diloco_node.outer.update import UpdateContext
from diloco_node.replica.base import settings_of
from diloco_node.replica.layout import flatten
from diloco_node.replica.single import SingleReplica
from diloco_node.round import Gathered, Outcome, PartSource, RoundReport
from diloco_node.swarm.groups import random_groups
from diloco_node.train.shares import data_stream_seed


class Room:
    """The in-memory swarm of one simulated run: each round's offers, and the bytes they moved.
    One condition guards everything in it."""

    def __init__(self, peers: list[str], run_id: str, group_size: int | None):
        self.peers, self.run_id, self.group_size = list(peers), run_id, group_size  # group_size: NoLoCo's n
        self.changed = threading.Condition()
        self.offers: dict[int, dict[str, tuple[bytes | None, float]]] = defaultdict(dict)
        self.payload_bytes = 0  # what every worker fetched from the others: the all-gather's traffic

    def offer(self, round_: int, peer: str, payload: bytes | None, tokens: float) -> None:
        with self.changed:
            self.offers[round_][peer] = (payload, tokens)
            for old in [r for r in self.offers if r < round_ - 4]:  # every worker is past them
                del self.offers[old]
            self.changed.notify_all()

    def wait_for(self, round_: int, members: Collection[str],
                 stop: threading.Event) -> dict[str, tuple[bytes | None, float]] | None:
        with self.changed:
            while not all(peer in self.offers[round_] for peer in members):
                if stop.is_set():
                    return None
                self.changed.wait(0.5)
            return {peer: self.offers[round_][peer] for peer in members}


@dataclass
class MemoryTransport:
    """round.Transport for one worker of a `Room`."""

    room: Room
    peer_id: str
    min_group_size: int = 2

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: PartSource | None = None) -> None:
        self.room.offer(round_, self.peer_id, payload, tokens)

    def gather(self, round_: int, contributing: bool, stop: threading.Event,
               among: Collection[str] | None = None, on_ready: Callable[[], None] | None = None) -> Gathered:
        if on_ready is not None:
            on_ready()
        others = [p for p in (among if among is not None else self.room.peers) if p != self.peer_id]
        if not others:
            return Gathered(Outcome.ALONE, round_)
        offers = self.room.wait_for(round_, others, stop)
        if offers is None:
            return Gathered(Outcome.STOPPED, round_)
        payloads = {peer: (payload, tokens) for peer, (payload, tokens) in offers.items() if payload is not None}
        received = sum(len(payload) for payload, _ in payloads.values())
        with self.room.changed:
            self.room.payload_bytes += received
        return Gathered(Outcome.TOGETHER, round_, payloads, 0.0, received)

    def gather_group_of(self, round_: int, member: str) -> Gathered:
        return Gathered(Outcome.ALONE, round_)  # nobody joins late in a simulated run

    def drawn_group(self, round_: int) -> list[str]:
        assert self.room.group_size, "groups are drawn for NoLoCo only"
        least = self.min_group_size if self.min_group_size > 2 else 1
        groups = random_groups(self.room.peers, self.room.run_id, round_, self.room.group_size, least)
        return next((group for group in groups if self.peer_id in group), [self.peer_id])

    def stop_sharing(self) -> None:
        pass

    def mark_exchanged(self, round_: int) -> None:
        pass

    def isolated(self) -> bool:
        return False

    def all_past(self, round_: int) -> bool:
        return False

    def peer_count(self) -> int:
        return len(self.room.peers)

    def diverged(self, round_: int, digest: str, among: Collection[str]) -> bool:
        return False  # every worker's φ is compared by the simulator itself (Simulation.digests)

    def served_diverged(self, among: Collection[str]) -> bool:
        return False


class Worker:
    """One simulated node: its parts as compose.build makes them, its replica, and its round."""

    def __init__(self, cfg: NodeConfig, peer_id: str, room: Room, phi: list[torch.Tensor], batches: int = 1,
                 inner_state: str = "keep"):
        self.cfg, self.peer_id = cfg, peer_id
        self.batches = batches  # batches per inner step: a faster worker's under --speed-spent batch
        # keep: the inner AdamW's moments carry from round to round, as a node's do; reset: each round
        # starts them afresh (a measurement of the alternative only: no node does it)
        self.inner_state = inner_state
        self.parts = build(cfg)
        self.state = self.parts.state
        with torch.no_grad():  # the run's φ, as a joiner downloads it from the node that started the run
            for mine, run in zip(self.state.phi, phi, strict=True):
                mine.copy_(run)
        transport = MemoryTransport(room, peer_id, cfg.averaging.min_group_size)
        ctx = UpdateContext(self.state, make_fragments(self.parts, peer_id), transport, self.parts.telemetry,
                            threading.Event(), threading.Event())
        self.update = make_update(cfg, ctx)
        self.replica = SingleReplica(settings_of(cfg))
        self.drift = Drift(self.parts.runs)
        self.stream_seed = data_stream_seed(peer_id, cfg.inputs.seed)
        self.position = 0
        self.replica.prepare_data(self.stream_seed, self.position)

    def inner_phase(self) -> list[float]:
        """θ ← φ, then this round's inner steps (node.Node._inner_phase with a fixed H), each of
        `batches` batches."""
        with self.state.lock:
            self.replica.load(self.drift.start(self.state.phi))
        if self.inner_state == "reset":
            self.replica.trainer.optimizer.state.clear()
        losses = []
        for _ in range(self.cfg.round_inner_steps(self.state.round)):
            losses.append(self.replica.train_step(self.stream_seed, self.position, self.batches))
            self.position += self.batches
        return losses

    def tokens(self, losses: list[float]) -> float:
        """What a round of `losses` inner steps trained: steps × batches × batch × seq_len."""
        return float(len(losses) * self.batches * self.cfg.inputs.batch_size * self.cfg.inputs.seq_len)

    def finish_round(self, losses: list[float]) -> RoundReport:
        """Δ = φ − θ, then the outer update (node.Node.run_round after the inner phase)."""
        delta = flatten(self.drift.delta(self.state.phi, self.replica.theta() or []))
        report = self.update.finish_round(self.state.round, delta, self.tokens(losses))
        self.drift.ended(self.state.round - 1 if report.stepped else self.state.round)
        return report

    def evaluate(self) -> float:
        with self.state.lock:
            self.replica.load(self.state.phi)
        return self.replica.evaluate()

    def close(self) -> None:
        self.replica.close()


@dataclass
class Curve:
    """A run's evaluations: (tokens per worker, eval loss of every worker's φ), and what it moved."""

    label: str
    points: list[tuple[int, list[float]]] = field(default_factory=list)
    digests: list[list[str]] = field(default_factory=list)  # per round, each worker's φ digest
    payload_bytes: list[int] = field(default_factory=list)  # per evaluation, payload bytes fetched so far (all workers)
    # per round, the share of the group's declared work the trust bounds took away (the first worker's
    # report: every member of an all-gather computes the same; outer/aggregate.removed_share)
    weight_removed: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"label": self.label, "points": self.points, "payload_bytes": self.payload_bytes,
                "weight_removed": self.weight_removed, "seconds": self.seconds}


def simulate(cfg: NodeConfig, peers: list[str], rounds: int, evaluate: bool = True,
             on_round: Callable[[int, Curve], bool] | None = None, speeds: tuple[int, ...] = (),
             spent: str = "steps", inner_state: str = "keep") -> Curve:
    """`rounds` rounds of len(peers) workers on `cfg` (each worker's seed: cfg.inputs.seed; its data stream
    from its peer id, as a node's). Stops early when `on_round` returns True. φ starts as a node
    with `cfg` builds it. `speeds`: each worker's speed over the slowest's, spent on steps or on
    batch (the module's docstring); the curve's tokens are the first worker's. `inner_state`: keep
    (a node's way) or reset the inner optimizer's moments at each round (Worker)."""
    if inner_state not in ("keep", "reset"):
        raise ValueError(f"the inner state is kept or reset, not {inner_state}")
    torch.set_num_threads(max(1, cfg.local.threads))
    cfg = cfg.replaced(checkpoint_dir="")  # a simulated worker keeps no checkpoint
    room = Room(peers, cfg.swarm.run_id, cfg.noloco.group_size if cfg.noloco.algorithm == "noloco" else None)
    phi = build(cfg).state.phi
    configs = [worker_config(cfg, speed, spent) for speed in speeds or (1,) * len(peers)]
    workers = [Worker(own, peer, room, phi, batches, inner_state)
               for peer, (own, batches) in zip(peers, configs, strict=True)]
    curve, started = Curve(label=""), time.monotonic()
    try:
        if evaluate:
            curve.points.append((0, [workers[0].evaluate()] * len(workers)))
            curve.payload_bytes.append(0)
        tokens = 0
        for _ in range(rounds):
            losses = [worker.inner_phase() for worker in workers]
            tokens += int(workers[0].tokens(losses[0]))
            first = _finish_together(workers, losses)
            curve.weight_removed.append(first.result.weight_removed if first.result is not None else 0.0)
            curve.digests.append([worker.state.digest() for worker in workers])
            if evaluate:
                curve.points.append((tokens, _evaluate_all(workers, curve.digests[-1])))
                curve.payload_bytes.append(room.payload_bytes)
            if on_round is not None and on_round(tokens, curve):
                break
        for worker in workers:  # delayed and eager apply what is in flight, as a node at the run's end
            worker.update.settle()
    finally:
        for worker in workers:
            worker.close()
    curve.seconds = time.monotonic() - started
    return curve


def worker_config(cfg: NodeConfig, speed: int, spent: str) -> tuple[NodeConfig, int]:
    """A worker `speed`× as fast as the slowest: its config and batches per step, its speed spent
    on `spent`: s·H steps of one batch, or H steps of s batches."""
    if spent not in ("steps", "batch"):
        raise ValueError(f"speed is spent on steps or batch, not {spent}")
    if spent == "batch" or speed == 1:
        return cfg, speed
    return cfg.replaced(inner_steps=cfg.inner.inner_steps * speed), 1


def _evaluate_all(workers: list[Worker], digests: list[str]) -> list[float]:
    """Each worker's eval loss of its φ; workers whose φ is the same (blocking: all) evaluated once."""
    losses: dict[str, float] = {}
    for worker, digest in zip(workers, digests, strict=True):
        if digest not in losses:
            losses[digest] = worker.evaluate()
    return [losses[digest] for digest in digests]


def _finish_together(workers: list[Worker], losses: list[list[float]]) -> RoundReport:
    """Every worker's finish_round at once (a blocking gather waits for the others' offers); the
    first worker's report."""
    errors: list[BaseException] = []
    reports: dict[int, RoundReport] = {}

    def finish(index: int, worker: Worker, mine: list[float]) -> None:
        try:
            reports[index] = worker.finish_round(mine)
        except BaseException as exc:  # re-raised on the simulator's thread
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=(index, worker, mine), name=f"finish-{index}")
               for index, (worker, mine) in enumerate(zip(workers, losses, strict=True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return reports[0]


def data_parallel(cfg: NodeConfig, peers: list[str], steps: int, eval_every: int,
                  on_eval: Callable[[int, Curve], bool] | None = None) -> Curve:
    """DDP over len(peers) workers (one worker: training alone): each step one batch of every
    worker's stream at the same position, gradients averaged, the node's AdamW and schedule (its
    total: `steps`). Tokens per worker on the curve."""
    torch.set_num_threads(max(1, cfg.local.threads))
    # the schedule spans `steps`; no checkpoint
    run = cfg.replaced(inner_steps=steps, max_outer_steps=1, checkpoint_dir="")
    replica = SingleReplica(settings_of(run))
    replica.load(build(run).state.phi)
    seeds = [data_stream_seed(peer, cfg.inputs.seed) for peer in peers]
    data = replica.dataset.dataset  # each stream by position, without the node's prefetch of one stream
    curve, started = Curve(label=""), time.monotonic()
    curve.points.append((0, [replica.evaluate()]))
    for step in range(steps):
        batches = [data.batch(cfg.inputs.batch_size, seed, step) for seed in seeds]
        replica.trainer.train_step(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.points.append(((step + 1) * cfg.inputs.batch_size * cfg.inputs.seq_len, [replica.evaluate()]))
            if on_eval is not None and on_eval(step + 1, curve):
                break
    curve.seconds = time.monotonic() - started
    replica.close()
    return curve
