"""A node that holds φ never installs a state farther from its own than the rounds between them can
move it under the clip (outer/reach.py, OuterState.install_shared; docs/architecture.md §9,
"Installing a state"): one peer that claims the run moved on, or wins a tie, cannot replace φ."""

from __future__ import annotations

import logging

import pytest
import torch

from diloco_node.outer import reach as reach_module
from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.outer.reach import REACH_BASE_ROUNDS, REACH_STEPS, Bound, Reach
from diloco_node.outer.state import OuterState

SHAPES = [(16, 8), (8,), (4, 4)]
NUMEL = sum(torch.Size(shape).numel() for shape in SHAPES)


ROUND_SECONDS = 60.0


class Clock:
    """Our monotonic clock, moved on a round by each outer step of `run`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:  # the wall clock: another origin, the same pace
        return self.now + 1.7e9


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(reach_module, "time", fake)
    return fake


def model(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 0.02 for shape in SHAPES]


def means(rounds: int, seed: int = 1) -> list[torch.Tensor]:
    """A run's mean pseudo-gradients: small, as an inner phase's Δ is beside φ."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=generator) * 1e-3 for _ in range(rounds)]


def diloco(phi: list[torch.Tensor]) -> OuterState:
    return OuterState(phi, OuterOptimizer(phi, 0.7, 0.9))


def run(state: OuterState, steps: list[torch.Tensor]) -> None:
    """Outer steps as blocking.py takes them, a round apart: the mean on φ, then the next round."""
    for mean in steps:
        time_now = reach_module.time
        assert isinstance(time_now, Clock)
        time_now.now += ROUND_SECONDS
        assert isinstance(state.optimizer, OuterOptimizer)
        with state.lock:
            state.optimizer.step(state.shaped(mean))
            state.round += 1


def shared(state: OuterState, server: str = "peer") -> tuple[dict[str, object], list[torch.Tensor]]:
    served = state.served(lambda: None)
    return state.shared("fp", server, lambda: served)


def refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and "refused state" in r.getMessage()]


def test_a_far_away_state_is_refused_with_one_line_and_phi_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    """The attack of issue 40: a proven partner claims a later round and serves φ all 0.5."""
    run_means = means(5)
    ours = diloco(model())
    run(ours, run_means[:4])
    before = ours.flat().clone()
    metadata, vectors = shared(ours, "attacker")
    for ahead in (1, 3, 10**6):  # a claim of any round: the rounds are capped by our own clock
        forged = {**metadata, "round": ours.round + ahead}
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            assert ours.install_shared(forged, [torch.full((NUMEL,), 0.5), vectors[1]], "fp") is None
        assert len(refusals(caplog)) == 1 and "attacker" in refusals(caplog)[0].getMessage()
        assert torch.equal(ours.flat(), before) and ours.round == 4


def test_a_nearby_honest_state_one_round_ahead_is_taken(caplog: pytest.LogCaptureFixture) -> None:
    """The run's state one real outer step past ours (the round we missed) installs, momentum and all."""
    run_means = means(5)
    ours, server = diloco(model()), diloco(model())
    run(ours, run_means[:4])
    run(server, run_means[:5])
    metadata, vectors = shared(server)
    assert metadata["round"] == 5
    with caplog.at_level(logging.WARNING):
        assert ours.install_shared(metadata, vectors, "fp") is not None
    assert not refusals(caplog)
    assert torch.equal(ours.flat(), server.flat()) and ours.round == 5


def test_a_split_at_the_same_round_within_a_step_is_taken() -> None:
    """A pair split by a one-sided exchange failure: one member stepped with its own Δ only."""
    run_means = means(5)
    ours, majority = diloco(model()), diloco(model())
    run(ours, run_means[:3] + [run_means[3] * 2])
    run(majority, run_means[:4])
    assert ours.install_shared(*shared(majority), "fp") is not None


def test_a_huge_momentum_beside_our_own_phi_is_refused() -> None:
    """The next step would carry φ away: the buffer is bounded as φ is (F/(1 − μ), with slack)."""
    ours = diloco(model())
    run(ours, means(4))
    metadata, vectors = shared(ours)
    assert ours.install_shared(metadata, [vectors[0], vectors[1] * 1e6], "fp") is None
    assert ours.install_shared(metadata, vectors, "fp") is not None  # ours, as it is: taken


def test_a_node_without_phi_of_the_run_takes_any_state() -> None:
    """A joiner (no outer step since start) has nothing to compare: today's behaviour."""
    joiner = diloco(model(seed=3))
    metadata, vectors = shared(diloco(model()))
    assert joiner.install_shared({**metadata, "round": 40}, [torch.full((NUMEL,), 0.5), vectors[1]], "fp")
    assert torch.equal(joiner.flat(), torch.full((NUMEL,), 0.5))


def test_zero_means_bound_the_reach_to_nothing() -> None:
    """A partner that sent only zero payloads (proven by them) moved nothing: it can move nothing."""
    ours = diloco(model())
    run(ours, [torch.zeros(NUMEL)] * 3)
    metadata, vectors = shared(ours)
    moved = vectors[0] + 1e-3
    assert ours.install_shared({**metadata, "round": ours.round + 2}, [moved, vectors[1]], "fp") is None


def test_noloco_nodes_refuse_a_far_state_and_take_their_groups() -> None:
    """NoLoCo's φ differs per node by design and has no digest check: the bound still holds."""
    def noloco(phi: list[torch.Tensor]) -> OuterState:
        return OuterState(phi, NoLoCoOptimizer(phi, 0.7, 0.5, 0.7))

    ours, other = noloco(model()), noloco(model(seed=1))
    for mean in means(4):
        mean_phi = (ours.flat() + other.flat()) / 2
        for state in (ours, other):
            assert isinstance(state.optimizer, NoLoCoOptimizer)
            with state.lock:
                state.optimizer.step(state.shaped(mean), state.shaped(mean_phi))
                state.round += 1
    metadata, vectors = shared(other)
    assert ours.install_shared({**metadata, "round": 5}, [torch.full((NUMEL,), 0.5), vectors[1]], "fp") is None
    assert ours.install_shared({**metadata, "round": 5}, vectors, "fp") is not None


def test_the_rounds_between_are_capped_by_our_own_clock(clock: Clock) -> None:
    """A server's round is its word: without a measured pace a claim counts for a few rounds only,
    with one for the rounds our shortest step interval fits since φ last moved."""
    reach = Reach(0.9)
    assert reach.bound(5) is None  # nothing measured: no φ of the run
    reach.stepped(1.0, 1.0)
    untimed = reach.bound(10**9)
    assert untimed is not None and untimed.rounds < 20
    assert untimed.distance == pytest.approx(untimed.rounds * 1.0 * 2.0 / (1 - 0.9))
    for _ in range(REACH_STEPS + 4):
        clock.now += ROUND_SECONDS
        reach.stepped(0.5, 0.5)  # the force of the first step is forgotten after REACH_STEPS
    bound = reach.bound(3)
    assert bound is not None and bound.rounds == 1 + 2  # just stepped: the run can be a round on at most
    clock.now += 10 * ROUND_SECONDS  # paused ten rounds (isolated): the run may be that far on
    far = reach.bound(10**9)
    assert far is not None and far.rounds == 10 + 1 + 2
    assert bound is not None and bound.distance == pytest.approx(bound.rounds * 0.5 * 2.0 / (1 - 0.9))
    reach.installed(3.0, 2)  # a state 2 rounds on installed now: the rounds count from our last step, less its move
    after = reach.bound(10**9)
    assert after is not None and after.rounds == far.rounds and after.distance == pytest.approx(far.distance - 3.0)
    reach.installed(10**6, 0)
    assert reach.bound(10**9) == Bound(far.rounds, 0.0, far.momentum)
    reach.stepped(0.5, 0.5)  # our own step: installs before it no longer count
    assert reach.bound(3) == bound


def test_states_installed_one_after_another_walk_phi_no_farther_than_one_could(clock: Clock) -> None:
    """One peer that makes us install its state again and again, each within the reach of the one
    before, moves φ in all no farther from where our last outer step left it than one state could."""
    ours = diloco(model())
    run(ours, means(6))
    start = ours.flat()
    bound = ours.optimizer.reach.bound(3)
    assert bound is not None
    metadata, vectors = shared(ours)
    direction = torch.ones(NUMEL) / NUMEL ** 0.5
    taken = 0
    for _ in range(40):
        # each hop half the bound past the φ we hold now, one round on
        hop_phi = ours.flat() + direction * (bound.distance / 2)
        if ours.install_shared({**metadata, "round": ours.round + 1}, [hop_phi, vectors[1]], "fp") is not None:
            taken += 1
    assert taken <= 2
    assert float((ours.flat() - start).norm()) <= bound.distance * (1 + 1e-6)


def test_a_node_resumed_from_its_checkpoint_keeps_the_reach_of_its_last_steps(clock: Clock) -> None:
    """A checkpoint keeps the forces and times of our last outer steps (as JSON, on the wall clock):
    after a restart a far state is refused as before it, where a resumed node took any state."""
    import json

    ours = diloco(model())
    run(ours, means(6))
    checkpoint = json.loads(json.dumps(ours.saved()["reach"]))  # what the manifest holds
    metadata, vectors = shared(ours)
    far = [torch.full((NUMEL,), 0.5), vectors[1]]

    clock.now += 5.0  # restarted within a round
    resumed = diloco(model())
    resumed.install(ours.round, ours.phi, None)
    assert resumed.install_shared({**metadata, "round": ours.round + 1}, far, "fp") is not None  # nothing measured
    resumed = diloco(model())
    resumed.install(ours.round, ours.phi, None)
    assert resumed.optimizer.reach.restore(checkpoint)
    assert resumed.optimizer.reach.bound(3) == ours.optimizer.reach.bound(3)
    assert resumed.install_shared({**metadata, "round": ours.round + 1}, far, "fp") is None
    assert resumed.install_shared({**metadata, "round": ours.round + 1}, vectors, "fp") is not None


@pytest.mark.parametrize("damaged", [None, [], {"steps": [[1.0, 2.0]], "installed": 0},
                                     {"steps": [[1.0, 2.0, float("nan")]], "installed": 0},
                                     {"steps": [[1.0, 2.0, -3.0]], "installed": 0},
                                     {"steps": [[1.0, 2.0, True]], "installed": 0},
                                     {"steps": [[1.0, 2.0, 3.0]] * (REACH_STEPS + 1), "installed": 0},
                                     {"steps": "x", "installed": 0}, {"steps": [[1.0, 2.0, 3.0], "x"]}])
def test_a_damaged_record_of_our_steps_is_refused_whole(damaged: object) -> None:
    reach = Reach(0.9)
    assert not reach.restore(damaged)
    assert reach.bound(3) is None


def test_an_empty_record_is_nothing_measured_and_a_time_ahead_of_ours_is_now(clock: Clock) -> None:
    """A checkpoint taken before our first outer step keeps no step (honest: delayed's first round);
    a step timed ahead of our clock (set back since) counts as taken now, never as rounds owed."""
    reach = Reach(0.9)
    assert reach.restore({"steps": []}) and reach.bound(3) is None
    ahead = clock.time() + 3600
    assert reach.restore({"steps": [[ahead, 1.0, 1.0], [ahead + 60, 1.0, 1.0]]})
    bound = reach.bound(5)
    assert bound is not None and bound.rounds >= 1 + REACH_BASE_ROUNDS and bound.distance > 0


def test_an_honest_node_that_re_syncs_round_after_round_is_not_refused(clock: Clock) -> None:
    """A slow node, behind every round, re-syncs again and again without an outer step of its own:
    each state is the run's, farther on each time. The installs' rounds count with their distances,
    so the run's whole way since our last step stays allowed (before: the 6th was refused)."""
    ours, run_state = diloco(model()), diloco(model())
    steps = means(1) * 30  # one direction every round: momentum builds, φ moves as far as it can
    run(ours, steps[:6])
    run(run_state, steps[:6])
    for hop in range(8):  # the run moves on 2 rounds, and we take its state without stepping ourselves
        run(run_state, steps[6 + 2 * hop:8 + 2 * hop])
        metadata, vectors = shared(run_state)
        assert ours.install_shared(metadata, vectors, "fp") is not None, hop
