"""What an overlapped node serves joiners (OverlappedUpdate.served): φ with only the landed means
applied, the same bit for bit on nodes whose own Δs differ, and what a blocking node would hold.
The swarm and the averaging are stand-ins for their seams; the ledger and the optimizer are real."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import pytest
import torch

from diloco_node.config import NodeConfig
from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.fragments import Fragments
from diloco_node.outer.overlapped import OverlappedUpdate
from diloco_node.outer.state import OuterState
from diloco_node.outer.update import UpdateContext
from diloco_node.round import AverageResult, Gathered, Outcome, Own

NUMEL = 6


class Averaging:
    """Round r's mean is `means[r]`, whatever our own Δ was: both nodes of the group get it; in a
    round of `alone` we found nobody (the exchange failed on our side only)."""

    def __init__(self, means: list[torch.Tensor], alone: tuple[int, ...] = ()):
        self.means, self.alone = means, alone

    def encode(self, round_: int, delta: torch.Tensor, tokens: float) -> Own:
        return Own(b"payload", delta.clone(), tokens, 0.0)

    def parts(self, round_: int, own: Own) -> None:
        return None  # an all-gather run

    def mean(self, own: Own, gathered: Gathered) -> AverageResult:
        if gathered.round in self.alone:
            return AverageResult((), torch.zeros(NUMEL), 0.0, 0.0)
        return AverageResult(("a", "b"), self.means[gathered.round].clone(), 0.5, 0.0)

    def nothing(self, own: Own) -> AverageResult:
        return AverageResult((), torch.zeros(NUMEL), 0.0, 0.0)

    def mean_of(self, gathered: Gathered, member: str) -> torch.Tensor | None:
        """A round a state's server had in flight: the joiner computes the same mean."""
        return self.means[gathered.round].clone() if gathered.outcome == Outcome.TOGETHER else None


class Swarm:
    """The group of a round of `held` was smaller than --min-group-size (round.held)."""

    def __init__(self, held: tuple[int, ...] = ()) -> None:
        self.held = held
        self.peer_count = lambda: 2
        self.mark_exchanged = lambda round_: None
        self.served_diverged = lambda among: False

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: None = None) -> None:
        pass

    def gather(self, round_: int, contributing: bool, stop: threading.Event) -> Gathered:
        return Gathered(Outcome.HELD if round_ in self.held else Outcome.TOGETHER, round_)

    def gather_group_of(self, round_: int, member: str) -> Gathered:
        return Gathered(Outcome.TOGETHER, round_, {member: (b"payload", 100.0)})


class Telemetry:
    def update(self, **values: object) -> None:
        pass

    def clear_if(self, key: str, value: object) -> None:
        pass


def node(sync: str, means: list[torch.Tensor], alone: tuple[int, ...] = (),
         held: tuple[int, ...] = ()) -> OverlappedUpdate:
    phi = [torch.linspace(-1.0, 1.0, NUMEL).reshape(2, 3)]
    state = OuterState(phi, OuterOptimizer(phi, 0.7, 0.9))
    fragments = Fragments.whole([p.numel() for p in phi], Averaging(means, alone))  # type: ignore[arg-type]
    ctx = UpdateContext(state, fragments, Swarm(held), Telemetry(),  # type: ignore[arg-type]
                        threading.Event(), threading.Event())
    return OverlappedUpdate(ctx, state.optimizer, NodeConfig(sync=sync))  # type: ignore[arg-type]


@pytest.mark.parametrize("sync", ["eager", "delayed"])
def test_nodes_with_different_own_deltas_serve_the_same_state_as_a_blocking_node(sync: str) -> None:
    generator = torch.Generator().manual_seed(3)
    rounds = 5
    own = {name: [torch.randn(NUMEL, generator=generator) for _ in range(rounds)] for name in "ab"}
    means = [(x + y) / 2 for x, y in zip(own["a"], own["b"], strict=True)]
    a, b = node(sync, means), node(sync, means)
    for round_ in range(rounds):
        for update, name in ((a, "a"), (b, "b")):
            update.finish_round(round_, own[name][round_], 100.0)
            update.pending.wait(round_, 5.0)  # each exchange lands before the next round ends
    served_a, served_b = a.ctx.state.served(a.served), b.ctx.state.served(b.served)
    assert served_a.digest() == served_b.digest()  # what joiners check, bit for bit
    if sync == "eager":
        assert a.ctx.state.digest() != b.ctx.state.digest()  # while each φ holds its own Δ early
    assert served_a.round == rounds and served_a.in_flight == [rounds - 1]  # the last mean is not taken yet
    assert served_a.settled_round == rounds - 1

    blocking = [torch.linspace(-1.0, 1.0, NUMEL).reshape(2, 3)]
    optimizer = OuterOptimizer(blocking, 0.7, 0.9)
    for mean in means[:-1]:
        optimizer.step([mean.reshape(2, 3)])
    assert torch.equal(served_a.phi, blocking[0].flatten())
    assert torch.equal(served_a.momentum, optimizer.momentum_buffers()[0].flatten())


@pytest.mark.parametrize("sync", ["eager", "delayed"])
def test_held_rounds_step_nothing_and_nodes_still_serve_the_same_state(sync: str) -> None:
    """--min-group-size: a held round's own Δ, applied early by eager, is taken back, and the settled
    copy skips the round as a blocking node does, whatever each node's own Δ was."""
    generator = torch.Generator().manual_seed(6)
    rounds = 5
    means = [torch.randn(NUMEL, generator=generator) for _ in range(rounds)]
    a, b = node(sync, means, held=(1, 2)), node(sync, means, held=(1, 2))
    for round_ in range(rounds):
        for update in (a, b):
            update.finish_round(round_, torch.randn(NUMEL, generator=generator), 100.0)
            update.pending.wait(round_, 5.0)
    served_a, served_b = a.ctx.state.served(a.served), b.ctx.state.served(b.served)
    assert served_a.digest() == served_b.digest()
    blocking = [torch.linspace(-1.0, 1.0, NUMEL).reshape(2, 3)]
    optimizer = OuterOptimizer(blocking, 0.7, 0.9)
    for round_ in (0, 3):  # rounds 1 and 2 were held, round 4 is still in flight
        optimizer.step([means[round_].reshape(2, 3)])
    assert torch.equal(served_a.phi, blocking[0].flatten())
    assert torch.equal(served_a.momentum, optimizer.momentum_buffers()[0].flatten())


def test_a_round_averaged_alone_on_one_side_splits_the_served_state() -> None:
    """What the group's records then show (presence.diverged(served=True) re-syncs the minority)."""
    generator = torch.Generator().manual_seed(4)
    means = [torch.randn(NUMEL, generator=generator) for _ in range(4)]
    a, b = node("eager", means, alone=(1,)), node("eager", means)
    for round_ in range(4):
        for update in (a, b):
            update.finish_round(round_, torch.randn(NUMEL, generator=generator), 100.0)
            update.pending.wait(round_, 5.0)
    served_a, served_b = a.ctx.state.served(a.served), b.ctx.state.served(b.served)
    assert served_a.settled_round == served_b.settled_round == 3
    assert served_a.digest() != served_b.digest()


def test_a_joiner_of_the_served_state_holds_every_mean_once() -> None:
    """The joiner installs the settled copy and applies the round in flight whole when it lands."""
    generator = torch.Generator().manual_seed(5)
    means = [torch.randn(NUMEL, generator=generator) for _ in range(3)]
    server = node("eager", means)
    for round_ in range(2):
        server.finish_round(round_, torch.randn(NUMEL, generator=generator), 100.0)
        server.pending.wait(round_, 5.0)
    metadata, vectors = server.ctx.state.shared("fp", "server", server.served)
    assert metadata["round"] == 2 and metadata["in_flight"] == [1] and len(vectors) == 2

    joiner = node("eager", means)
    installed = joiner.ctx.state.install_shared(metadata, vectors, "fp")
    assert installed is not None
    _, in_flight = installed
    assert [(a.round, a.weight) for a in in_flight] == [(1, 0.0)]
    # a server may not claim rounds ahead of its own, or more than it can have pending
    assert joiner.ctx.state.install_shared({**metadata, "in_flight": [2]}, vectors, "fp") is None
    assert joiner.ctx.state.install_shared({**metadata, "in_flight": list(range(9))}, vectors, "fp") is None
    assert joiner.ctx.state.install_shared(metadata, [*vectors, vectors[0]], "fp") is None


def serving(sync: str, means: list[torch.Tensor], generator: torch.Generator) -> tuple[OverlappedUpdate, Any]:
    """A node that has run a round for each of `means` (its own Δs random), and the state it serves."""
    server = node(sync, means)
    for round_ in range(len(means)):
        server.finish_round(round_, torch.randn(NUMEL, generator=generator), 100.0)
        server.pending.wait(round_, 5.0)
    return server, server.ctx.state.shared("fp", "server", server.served)


def test_a_state_taken_in_the_last_round_settles_the_rounds_its_server_had_in_flight() -> None:
    """A node that re-syncs in the run's last round (its φ differed) takes a state whose last round
    is in flight, and settles at once: that round's mean is in its φ, as in its server's."""
    generator = torch.Generator().manual_seed(7)
    means = [torch.randn(NUMEL, generator=generator) for _ in range(3)]
    server, (metadata, vectors) = serving("eager", means, generator)
    assert metadata["in_flight"] == [2]

    joiner = node("eager", means)
    joiner.finish_round(0, torch.randn(NUMEL, generator=generator), 100.0)  # a node of the run: its Δ
    joiner.pending.wait(0, 5.0)
    installed = joiner.ctx.state.install_shared(metadata, vectors, "fp")
    assert installed is not None
    joiner.forget()
    joiner.inherit(*installed)
    assert joiner.ctx.state.served(joiner.served).in_flight == [2]  # until it is applied
    assert joiner.settle() is not None
    assert server.settle() is not None
    assert torch.equal(joiner.ctx.state.flat(), server.ctx.state.served(server.served).phi)
    assert joiner.ctx.state.served(joiner.served).in_flight == []


@pytest.mark.parametrize("huge", [False, True])
def test_a_round_inherited_from_a_server_is_bounded_by_our_own_delta(huge: bool, caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's round in flight may have been averaged by the server alone (or with one more
    identity of its own), which no group clipped: its mean is scaled down to a few of our own Δs
    when it is longer, and an honest one is taken whole (the same φ as the server's)."""
    generator = torch.Generator().manual_seed(8)
    means = [torch.randn(NUMEL, generator=generator) for _ in range(2)]
    server, (metadata, vectors) = serving("eager", means, generator)
    assert metadata["in_flight"] == [1]
    lied = [means[0], means[1] * (1e6 if huge else 1.0)]
    joiner = node("eager", lied)
    installed = joiner.ctx.state.install_shared(metadata, vectors, "fp")
    assert installed is not None
    joiner.inherit(*installed)
    before = joiner.ctx.state.flat()
    own = torch.randn(NUMEL, generator=generator) * 0.5 * float(means[1].norm()) / NUMEL ** 0.5
    # whatever an earlier test left (a level, or a logging config that disabled existing loggers)
    monkeypatch.setattr(logging.getLogger("diloco_node.outer.overlapped"), "disabled", False)
    with caplog.at_level(logging.WARNING, logger="diloco_node.outer.overlapped"):
        joiner.finish_round(2, own, 100.0)  # its first round: the inherited mean lands with it
    moved = float((joiner.ctx.state.flat() - before).norm())
    clipped = [r for r in caplog.records if "clipped the mean inherited" in r.getMessage()]
    if huge:
        assert clipped and moved < 100 * float(means[1].norm())
    else:
        assert not clipped
        server.finish_round(2, own, 100.0)  # the server lands its own round 1 with the same Δ of ours
        assert torch.equal(joiner.ctx.state.served(joiner.served).phi, server.ctx.state.served(server.served).phi)


def test_a_state_the_run_moved_past_caught_up_on_the_means_since_is_the_servers_current_one() -> None:
    """docs/architecture.md §14: a joiner whose download outlasted rounds applies the means of the
    rounds its state lacks (its own in flight, and those since) and holds, bit for bit, what the
    server serves now, with the server's rounds in flight still to inherit."""
    from diloco_node.outer.catchup import catch_up

    generator = torch.Generator().manual_seed(8)
    means = [torch.randn(NUMEL, generator=generator) for _ in range(7)]
    server = node("eager", means)
    old = None
    for round_ in range(6):
        server.finish_round(round_, torch.randn(NUMEL, generator=generator), 100.0)
        server.pending.wait(round_, 5.0)
        if round_ == 1:  # the joiner's download begins: the state served after round 1
            old = server.ctx.state.shared("fp", "server", server.served)
    assert old is not None and old[0]["round"] == 2 and old[0]["in_flight"] == [1]
    metadata, vectors = server.ctx.state.shared("fp", "server", server.served)
    assert metadata["round"] == 6 and metadata["in_flight"] == [5]

    joiner = node("eager", means)
    caught = catch_up(joiner.ctx, "server", old, 5, 6)
    assert caught is not None
    assert caught[0]["round"] == 6 and caught[0]["in_flight"] == [5] and caught[0]["has_momentum"]
    assert torch.equal(caught[1][0], vectors[0]) and torch.equal(caught[1][1], vectors[1])
    # a round whose group's payloads are gone: not caught up (the joiner refuses the state)
    gone = node("eager", means)
    gone_ctx = dataclasses.replace(gone.ctx, swarm=GoneServer())
    assert catch_up(gone_ctx, "server", old, 5, 6) is None
    assert catch_up(joiner.ctx, "server", (old[0], [old[1][0]]), 5, 6) is None  # not of the model's size


class GoneServer(Swarm):
    """The state's server has left (the run's end): its group's payloads can no longer be fetched."""

    def gather_group_of(self, round_: int, member: str) -> Gathered:
        return Gathered(Outcome.ALONE, round_)


def test_a_re_sync_mid_exchange_completes_our_own_round_from_our_own_exchange() -> None:
    """An eager node whose φ differed re-syncs while its own exchange of the round runs; the state
    it takes has that round in flight. Its own exchange (with the server in its group) gives the
    round's mean, also when the server has left and nothing can be fetched from it any more."""
    generator = torch.Generator().manual_seed(8)
    means = [torch.randn(NUMEL, generator=generator) for _ in range(4)]
    server, resyncing = node("eager", means), node("eager", means)
    for round_ in range(4):
        for update in (server, resyncing):
            update.finish_round(round_, torch.randn(NUMEL, generator=generator), 100.0)
    metadata, vectors = server.ctx.state.shared("fp", "a", server.served)  # "a": in the stand-in's groups
    assert 3 in metadata["in_flight"]
    installed = resyncing.ctx.state.install_shared(metadata, vectors, "fp")
    assert installed is not None
    resyncing.forget()  # as sync_from_peers does: our exchange of round 3 is dropped, still running
    resyncing.inherit(*installed)
    resyncing.ctx = dataclasses.replace(resyncing.ctx, swarm=GoneServer())  # type: ignore[arg-type]
    resyncing.settle()
    server.settle()
    assert torch.equal(resyncing.ctx.state.flat(), server.ctx.state.served(server.served).phi)
