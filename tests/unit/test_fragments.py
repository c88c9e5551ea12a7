"""Streaming fragments (docs/architecture.md §15): the cut, the schedule, θ between rounds, the outer step
per fragment against hand-computed values, the per-fragment ledger of eager rounds, and P = 1 being
the round as it always was. The swarm and the averaging are stand-ins for their seams; the cut, the
optimizers, the updates and the ledger are real."""

from __future__ import annotations

import itertools
import random
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from diloco_node.codec import CodecConfig, make_codec
from diloco_node.config import NodeConfig
from diloco_node.daemon.checkpoint import CheckpointStore
from diloco_node.outer.blocking import BlockingUpdate
from diloco_node.outer.diloco import OuterOptimizer, pseudo_gradient
from diloco_node.outer.fragments import Drift, Fragments, codec_state, load_codec_state, split
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.outer.overlapped import OverlappedUpdate
from diloco_node.outer.state import OuterState
from diloco_node.outer.sync import Applied
from diloco_node.outer.update import UpdateContext
from diloco_node.replica.layout import flatten, unflatten
from diloco_node.round import AverageResult, Gathered, Outcome, Own

# --- the cut ------------------------------------------------------------------------------------


def test_equal_tensors_are_cut_evenly_in_canonical_order() -> None:
    assert split([3] * 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert split([3] * 6, 1) == [range(0, 6)]
    assert split([3] * 6, 6) == [range(i, i + 1) for i in range(6)]


def test_a_tensor_larger_than_the_share_is_a_fragment_of_its_own() -> None:
    assert split([10] + [1] * 10, 2) == [range(0, 1), range(1, 11)]
    assert split([1] * 10 + [10], 2) == [range(0, 10), range(10, 11)]


def _largest(numels: list[int], runs: list[range]) -> int:
    return max(sum(numels[i] for i in run) for run in runs)


def test_the_cut_has_the_least_largest_fragment_of_any_cut() -> None:
    """Against every cut of small random lists: contiguous, in order, none empty, and no cut has a
    smaller largest fragment (the round's peak payload)."""
    generator = random.Random(5)
    for _ in range(200):
        numels = [generator.randint(1, 50) for _ in range(generator.randint(1, 8))]
        for count in range(1, len(numels) + 1):
            runs = split(numels, count)
            assert len(runs) == count and all(len(run) > 0 for run in runs)
            assert [i for run in runs for i in run] == list(range(len(numels)))
            best = min(_largest(numels, [range(a, b) for a, b in zip((0, *cuts), (*cuts, len(numels)), strict=True)])
                       for cuts in itertools.combinations(range(1, len(numels)), count - 1))
            assert _largest(numels, runs) == best


@pytest.mark.parametrize("count", [0, -1, 4])
def test_no_cut_into_no_fragments_or_more_than_tensors(count: int) -> None:
    with pytest.raises(ValueError, match="fragments"):
        split([1, 2, 3], count)


# --- the schedule and the config -----------------------------------------------------------------

@pytest.mark.parametrize("inner_steps,fragments", [(50, 1), (50, 4), (7, 3), (5, 5), (12, 4)])
def test_any_p_consecutive_rounds_run_h_inner_steps(inner_steps: int, fragments: int) -> None:
    cfg = NodeConfig(inner_steps=inner_steps, fragments=fragments)
    steps = [cfg.round_inner_steps(r) for r in range(3 * fragments + 2)]
    assert all(s >= 1 for s in steps)
    assert all(sum(steps[r:r + fragments]) == inner_steps for r in range(len(steps) - fragments + 1))
    assert [cfg.inner_steps_before(r) for r in range(len(steps))] == [sum(steps[:r]) for r in range(len(steps))]


def test_one_fragment_is_h_steps_a_round() -> None:
    cfg = NodeConfig(inner_steps=50)
    assert cfg.outer.fragments == 1
    assert [cfg.round_inner_steps(r) for r in range(3)] == [50, 50, 50]
    assert cfg.inner_steps_before(7) == 350


@pytest.mark.parametrize("values,words", [({"fragments": 0}, "fragments"), ({"fragments": -2}, "fragments"),
                                          ({"fragments": 6, "inner_steps": 5}, "more than inner_steps 5")])
def test_bad_fragment_counts_are_refused(values: dict[str, int], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        NodeConfig(**values)


def test_the_fragment_count_is_part_of_the_run_but_one_changes_nothing() -> None:
    assert NodeConfig(fragments=1).fingerprint() == NodeConfig().fingerprint()
    assert "fragments" not in NodeConfig().fingerprint_fields()
    assert NodeConfig(fragments=2).fingerprint_fields()["fragments"] == 2
    assert NodeConfig(fragments=2).fingerprint() != NodeConfig().fingerprint()


# --- stand-ins for the seams --------------------------------------------------------------------

class Averaging:
    """Round r's mean is `means[r]`; records the length of each Δ it was given to encode."""

    def __init__(self, means: dict[int, torch.Tensor], numel: int):
        self.means, self.numel, self.encoded = means, numel, list[int]()

    def encode(self, round_: int, delta: torch.Tensor, tokens: float, phi: torch.Tensor | None = None) -> Own:
        self.encoded.append(delta.numel())
        return Own(b"payload", delta.clone(), tokens, 0.0)

    def parts(self, round_: int, own: Own) -> None:
        return None

    def mean(self, own: Own, gathered: Gathered) -> AverageResult:
        return AverageResult(("a", "b"), self.means[gathered.round].clone(), 0.5, 0.0)

    def nothing(self, own: Own) -> AverageResult:
        return AverageResult((), torch.zeros(self.numel), 0.0, 0.0)


class Swarm:
    def __init__(self) -> None:
        self.peer_count = lambda: 2
        self.mark_exchanged = lambda round_: None
        self.served_diverged = lambda among: False
        self.isolated = lambda: False
        self.diverged = lambda round_, digest, group: False
        self.stop_sharing = lambda: None

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: None = None) -> None:
        pass

    def gather(self, round_: int, contributing: bool, stop: threading.Event, on_ready: object = None) -> Gathered:
        return Gathered(Outcome.TOGETHER, round_)


class Telemetry:
    def update(self, **values: object) -> None:
        pass

    def clear_if(self, key: str, value: object) -> None:
        pass


def _context(state: OuterState, averagings: list[Averaging]) -> UpdateContext:
    numels = [p.numel() for p in state.phi]
    fragments = Fragments(numels, split(numels, len(averagings)), averagings)  # type: ignore[arg-type]
    return UpdateContext(state, fragments, Swarm(), Telemetry(),  # type: ignore[arg-type]
                         threading.Event(), threading.Event())


# --- P = 1 is the round as it always was -------------------------------------------------------

def _phi() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator),
            torch.randn(2, 2, generator=generator)]


def test_one_fragment_keeps_theta_and_delta_as_they_were() -> None:
    phi = _phi()
    drift = Drift(split([p.numel() for p in phi], 1))
    assert drift.start(phi) is phi  # θ ← φ itself, every round, no copy
    theta = [p + 0.125 for p in phi]
    assert all(torch.equal(a, b) for a, b in zip(drift.delta(phi, theta), pseudo_gradient(phi, theta), strict=True))
    drift.ended(0)
    assert drift.start(phi) is phi


def test_one_fragment_blocking_phi_is_bit_identical_to_one_whole_step() -> None:
    """The reference is the step as it was before fragments: SGD over all of φ with the whole mean."""
    generator = torch.Generator().manual_seed(2)
    phi, reference = _phi(), _phi()
    numel = sum(p.numel() for p in phi)
    means = {r: torch.randn(numel, generator=generator) for r in range(5)}
    state = OuterState(phi, OuterOptimizer(phi, 0.7, 0.9))
    averaging = Averaging(means, numel)
    update = BlockingUpdate(_context(state, [averaging]), state.optimizer)  # type: ignore[arg-type]
    whole = OuterOptimizer(reference, 0.7, 0.9)
    for round_ in range(5):
        update.finish_round(round_, torch.randn(numel, generator=generator), 1.0)
        whole.step(unflatten(means[round_], reference))
    assert flatten(phi).numpy().tobytes() == flatten(reference).numpy().tobytes()
    assert averaging.encoded == [numel] * 5


def test_one_fragment_eager_phi_is_bit_identical_to_the_ledger_of_one_whole_vector() -> None:
    """Eager, proxy full: round t applies Σ (Δ̄_r − Δ_r) of the means landed since + Δ_t (docs/architecture.md
    §3), in one SGD step over all of φ; then settle applies the last correction."""
    generator = torch.Generator().manual_seed(4)
    phi, reference = _phi(), _phi()
    numel = sum(p.numel() for p in phi)
    means = {r: torch.randn(numel, generator=generator) for r in range(4)}
    own = [torch.randn(numel, generator=generator) for _ in range(4)]
    state = OuterState(phi, OuterOptimizer(phi, 0.7, 0.6))
    update = OverlappedUpdate(_context(state, [Averaging(means, numel)]), state.optimizer,  # type: ignore[arg-type]
                              NodeConfig(sync="eager", sync_timeout=30))
    whole = OuterOptimizer(reference, 0.7, 0.6)
    for round_ in range(4):
        update.finish_round(round_, own[round_], 1.0)
        total = torch.zeros(numel)
        if round_ > 0:
            total += means[round_ - 1] - 1.0 * own[round_ - 1]
        whole.step(unflatten(total + 1.0 * own[round_], reference))
    update.settle()
    total = torch.zeros(numel)
    total += means[3] - 1.0 * own[3]
    whole.step(unflatten(total, reference))
    assert flatten(phi).numpy().tobytes() == flatten(reference).numpy().tobytes()


# --- P = 2: the outer step per fragment --------------------------------------------------------

def test_each_fragment_steps_on_its_own_momentum_as_computed_by_hand() -> None:
    """φ_a = [1, 2], φ_b = [3, 4]; η = 0.5, μ = 0.5; b ← μ·b + Δ̄, φ ← φ − η·(Δ̄ + μ·b) for the
    round's fragment only (docs/architecture.md §15):
      r0 (a): Δ̄ = [.2, .4]  b_a = [.2, .4]    φ_a = [1, 2] − .5·[.3, .6]       = [.85, 1.7]
      r1 (b): Δ̄ = [.4, −.2] b_b = [.4, −.2]   φ_b = [3, 4] − .5·[.6, −.3]      = [2.7, 4.15]
      r2 (a): Δ̄ = [.2, 0]   b_a = [.3, .2]    φ_a = [.85, 1.7] − .5·[.35, .1]  = [.675, 1.65]
      r3 (b): Δ̄ = [0, 0]    b_b = [.2, −.1]   φ_b = [2.7, 4.15] − .5·[.1, −.05] = [2.65, 4.175]
    φ_a does not move in r1 nor φ_b in r2: one shared momentum would have moved both."""
    phi = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    state = OuterState(phi, OuterOptimizer(phi, 0.5, 0.5))
    means = {0: torch.tensor([0.2, 0.4]), 1: torch.tensor([0.4, -0.2]), 2: torch.tensor([0.2, 0.0]),
             3: torch.tensor([0.0, 0.0])}
    averagings = [Averaging(means, 2), Averaging(means, 2)]
    update = BlockingUpdate(_context(state, averagings), state.optimizer)  # type: ignore[arg-type]
    expected = [([0.85, 1.7], [3.0, 4.0]), ([0.85, 1.7], [2.7, 4.15]), ([0.675, 1.65], [2.7, 4.15]),
                ([0.675, 1.65], [2.65, 4.175])]
    for round_, (a, b) in enumerate(expected):
        update.finish_round(round_, torch.tensor([9.0, 9.0, 7.0, 7.0]), 1.0)
        assert phi[0].tolist() == pytest.approx(a, abs=1e-6) and phi[1].tolist() == pytest.approx(b, abs=1e-6)
    # each round sent its own fragment's part of Δ only
    assert averagings[0].encoded == [2, 2] and averagings[1].encoded == [2, 2]
    momentum = state.momentum()
    assert momentum is not None
    assert momentum[0].tolist() == pytest.approx([0.3, 0.2]) and momentum[1].tolist() == pytest.approx([0.2, -0.1])


def test_a_fragment_not_yet_stepped_resumes_from_zero_momentum_bit_for_bit() -> None:
    """A checkpoint stores zeros for a fragment that has not stepped; its first step after a resume is the
    first step it would have taken (b = μ·0 + Δ̄ = Δ̄)."""
    phi, resumed = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [torch.tensor([1.0, 2.0]),
                                                                          torch.tensor([3.0, 4.0])]
    straight, later = OuterOptimizer(phi, 0.7, 0.9), OuterOptimizer(resumed, 0.7, 0.9)
    straight.step([torch.tensor([0.3, -0.1])], first=0)
    later.step([torch.tensor([0.3, -0.1])], first=0)
    later.load_momentum([m.clone() for m in later.momentum_buffers()])  # the second is zeros, as saved
    for optimizer in (straight, later):
        optimizer.step([torch.tensor([0.25, 0.5])], first=1)
    assert all(torch.equal(a, b) for a, b in zip(phi, resumed, strict=True))


def test_noloco_steps_only_the_fragment_it_is_given() -> None:
    phi = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    optimizer = NoLoCoOptimizer(phi, alpha=0.5, beta=0.5, gamma=0.5)
    optimizer.step([torch.tensor([0.2, 0.4])], [torch.tensor([3.2, 3.6])], first=1)
    # m = −α·Δ̄ + γ·(φ̄ − φ) = [−.1, −.2] + [.1, −.2] = [0, −.4]
    assert phi[0].tolist() == [1.0, 2.0]
    assert phi[1].tolist() == pytest.approx([3.0, 3.6])
    assert optimizer.momentum_buffers()[0].tolist() == [0.0, 0.0]


# --- P = 2: θ between rounds --------------------------------------------------------------------

def test_theta_of_the_other_fragments_keeps_training_and_delta_is_against_where_it_started() -> None:
    phi = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])]
    drift = Drift(split([2, 2], 2))
    theta = [t.clone() for t in drift.start(phi)]
    assert all(torch.equal(a, b) for a, b in zip(theta, phi, strict=True))
    theta[0] -= 0.5
    theta[1] -= 0.25  # round 0's inner phase
    assert flatten(drift.delta(phi, theta)).tolist() == [0.5, 0.5, 0.25, 0.25]
    phi[0] -= 0.5  # round 0 stepped fragment 0
    phi[1] += 10.0  # a late correction moved fragment 1's φ: not our progress
    drift.ended(0)
    loaded = drift.start(phi)
    assert loaded[0].tolist() == [0.5, 0.5]  # fragment 0 restarts from its new φ
    assert loaded[1].tolist() == [1.75, 1.75]  # fragment 1 goes on from where round 0 left it
    theta = [t.clone() for t in loaded]
    theta[1] -= 0.25  # round 1's inner phase
    assert flatten(drift.delta(phi, theta)).tolist() == pytest.approx([0.0, 0.0, 0.5, 0.5])
    drift.forget()  # a state download: all of θ restarts from φ
    assert all(torch.equal(a, b) for a, b in zip(drift.start(phi), phi, strict=True))


# --- θ in the checkpoint: a resume keeps the other fragments' drift ---------------------------------

def _train(theta: list[torch.Tensor], round_: int) -> list[torch.Tensor]:
    """A stand-in inner phase: every tensor of θ moves, by an amount of its own each round."""
    generator = torch.Generator().manual_seed(100 + round_)
    return [t - 0.01 * torch.randn(t.shape, generator=generator) for t in theta]


def _round(drift: Drift, phi: list[torch.Tensor], round_: int, runs: list[range]) -> torch.Tensor:
    """One round of daemon/node.py with P fragments: start, inner phase, Δ, the fragment's step on φ, ended."""
    theta = _train([t.clone() for t in drift.start(phi)], round_)
    delta = drift.delta(phi, theta)
    for index in runs[round_ % len(runs)]:  # a stand-in outer step of the round's fragment only
        phi[index] = phi[index] - 0.7 * delta[index]
    drift.ended(round_)
    return flatten(delta)


@pytest.mark.parametrize("stopped_mid_round", [False, True], ids=["after-a-round", "mid-inner-phase"])
def test_theta_resumes_bit_exactly_from_a_checkpoint(tmp_path: Path, stopped_mid_round: bool) -> None:
    """A node that stops and resumes goes on with the same θ and origins (the fragments' local progress
    since their last exchange), so every later round's Δ is bit for bit the one it would have sent
    without the stop. Without them (θ from φ, as before) the Δs differ: the test can fail."""
    phi = _phi()
    runs = split([p.numel() for p in phi], 3)
    running = Drift(runs)
    for round_ in range(4):  # rounds 0–3: fragment 0 was exchanged twice, θ of 1 and 2 runs ahead
        _round(running, phi, round_, runs)
    if stopped_mid_round:  # a stop during round 4's inner phase: the round's start is what is saved
        running.start(phi)
    store = CheckpointStore(tmp_path)
    store.save({"outer_params": phi, "drift": running.saved()})
    loaded = store.load()
    store.close()
    assert loaded is not None
    resumed, fresh = Drift(runs), Drift(runs)
    assert resumed.restore(loaded["drift"], loaded["outer_params"])
    phi_resumed = list(loaded["outer_params"])
    phi_fresh = [p.clone() for p in phi_resumed]
    assert all(torch.equal(a, b) for a, b in zip(phi_resumed, phi, strict=True))
    for round_ in range(4, 9):
        expected = _round(running, phi, round_, runs)
        assert torch.equal(_round(resumed, phi_resumed, round_, runs), expected), round_
        if round_ == 4:
            assert not torch.equal(_round(fresh, phi_fresh, round_, runs), expected)  # what was lost before
    assert all(torch.equal(a, b) for a, b in zip(phi_resumed, phi, strict=True))


def test_theta_is_saved_only_with_fragments_and_refused_when_it_does_not_fit() -> None:
    phi = _phi()
    one = Drift(split([p.numel() for p in phi], 1))
    one.start(phi)
    assert one.saved() is None  # P = 1: θ ← φ every round, the checkpoint is as it was
    runs = split([p.numel() for p in phi], 3)
    drift = Drift(runs)
    assert drift.saved() is None  # no inner phase yet: θ is φ
    _round(drift, phi, 0, runs)
    saved = drift.saved()
    assert saved is not None and saved["theta"][0] is None and saved["origin"][0] is None  # due: reloaded from φ
    for bad in (None, {"theta": saved["theta"][:2], "origin": saved["origin"][:2]},
                {"theta": [None, torch.zeros(7), None], "origin": saved["origin"]},
                {"theta": saved["theta"], "origin": [None, saved["origin"][1].double(), saved["origin"][2]]},
                {"theta": [None, saved["theta"][1] * float("nan"), saved["theta"][2]], "origin": saved["origin"]}):
        other = Drift(runs)
        assert not other.restore(bad, phi) and other.theta is None  # θ then starts from φ
        assert all(torch.equal(a, b) for a, b in zip(other.start(phi), phi, strict=True))


# --- P = 2, eager: the ledger per fragment ------------------------------------------------------

def test_eager_fragments_apply_each_mean_once_at_their_own_next_step() -> None:
    """η = 1, μ = 0 so φ moves by exactly what is applied. Eager (w = 1): round t applies its own Δ_t to
    its fragment at once; round r's mean, landed during round r + 1, is owed to its fragment until that
    fragment's next round; settle applies the rest. After settle φ_f = φ_f(0) − Σ_{r of f} Δ̄_r."""
    phi = [torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0])]
    state = OuterState(phi, OuterOptimizer(phi, 1.0, 0.0))
    means = {r: torch.tensor([float(r + 1), 10.0 * (r + 1)]) for r in range(4)}
    own = [torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.25, 0.125, 0.125]),
           torch.tensor([1.0, 1.0, 2.0, 2.0]), torch.tensor([4.0, 4.0, 3.0, 3.0])]
    update = OverlappedUpdate(_context(state, [Averaging(means, 2), Averaging(means, 2)]),  # type: ignore[arg-type]
                              state.optimizer, NodeConfig(sync="eager", sync_timeout=30))
    update.finish_round(0, torch.tensor([0.5, 0.5, 9.0, 9.0]), 1.0)
    assert phi[0].tolist() == [-0.5, -0.5] and phi[1].tolist() == [0.0, 0.0]
    update.finish_round(1, own[1], 1.0)  # round 0's mean landed, owed to fragment 0: not applied yet
    assert phi[0].tolist() == [-0.5, -0.5] and phi[1].tolist() == [-0.125, -0.125]
    update.finish_round(2, own[2], 1.0)  # fragment 0: Δ̄_0 − Δ_0 + Δ_2
    assert phi[0].tolist() == [-1.0 - 1.0, -10.0 - 1.0]
    assert update.outstanding()[0].round == 1  # round 1 landed but is owed: a checkpoint keeps it
    update.finish_round(3, own[3], 1.0)
    update.settle()
    assert phi[0].tolist() == [-(1.0 + 3.0), -(10.0 + 30.0)]
    assert phi[1].tolist() == [-(2.0 + 4.0), -(20.0 + 40.0)]
    assert update.outstanding() == []


def test_a_fragment_codec_state_travels_per_fragment() -> None:
    codecs = [make_codec(CodecConfig(name="topk")) for _ in range(2)]
    codecs[0].encode(torch.linspace(-1, 1, 512))
    codecs[1].encode(torch.linspace(-2, 2, 256))
    saved = codec_state(codecs)
    fresh = [make_codec(CodecConfig(name="topk")) for _ in range(2)]
    load_codec_state(fresh, saved)
    assert [c.state_dict()["residual"].numel() for c in fresh] == [512, 256]
    assert torch.equal(fresh[1].state_dict()["residual"], codecs[1].state_dict()["residual"])
    one = [make_codec(CodecConfig(name="topk"))]
    one[0].encode(torch.ones(64))
    assert codec_state(one).keys() == one[0].state_dict().keys()  # one fragment: the checkpoint as it was


def test_a_checkpoint_keeps_each_fragments_state(tmp_path: Path) -> None:
    """Through the real store: the momentum of a fragment stepped and of one not yet stepped, each
    fragment's codec residual, and a Δ owed to a fragment (its own length) come back as saved."""
    phi = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]
    state = OuterState(phi, OuterOptimizer(phi, 0.7, 0.9))
    state.optimizer.step([torch.tensor([0.5, -0.5])], first=0)
    codecs = [make_codec(CodecConfig(name="topk")) for _ in range(2)]
    codecs[1].encode(torch.tensor([0.1, -0.2, 0.3]))
    owed = Applied(3, torch.tensor([0.25, 0.5, 0.75]), 1.0, 2)
    store = CheckpointStore(tmp_path)
    store.save({**state.saved(), "codec": codec_state(codecs), "outstanding": [asdict(owed)]})
    saved = store.load()
    store.close()
    assert saved is not None
    twin = OuterState([torch.zeros(2), torch.zeros(3)], OuterOptimizer([torch.zeros(2), torch.zeros(3)], 0.7, 0.9))
    twin.install(saved["round"], saved["outer_params"], saved["momentum"])
    for mine, theirs in zip(state.optimizer.momentum_buffers(), twin.optimizer.momentum_buffers(), strict=True):
        assert torch.equal(mine, theirs)
    fresh = [make_codec(CodecConfig(name="topk")) for _ in range(2)]
    load_codec_state(fresh, saved["codec"])
    assert fresh[0].state_dict() == {} and torch.equal(fresh[1].state_dict()["residual"],
                                                       codecs[1].state_dict()["residual"])
    restored = Applied(**saved["outstanding"][0])
    assert restored.round == 3 and torch.equal(restored.own, owed.own)
