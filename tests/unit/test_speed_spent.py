"""`--speed-spent batch` (docs/architecture.md §13, "Speed spent on steps or on batch"): every node runs
H inner steps a round and a faster one accumulates more batches into each, sized to the deadline. The
k arithmetic by hand, a node whose speed changes 4× between rounds, the weights and the trust bounds
for nodes of equal steps and different batches, and that the default (`steps`) is as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diloco_node.config import NodeConfig, build_config
from diloco_node.daemon.budget import MAX_ACCUMULATION, StepClock, accumulation, next_batches
from diloco_node.daemon.node import Node
from diloco_node.outer.aggregate import Contribution, aggregate, removed_share
from diloco_node.replica.base import ReplicaSettings, settings_of
from diloco_node.replica.single import SingleReplica
from diloco_node.train.inner import InnerConfig, InnerTrainer
from diloco_node.train.manifest import ManifestConflict, build, take
from diloco_node.train.model import build_model
from diloco_node.trust.work import PEER_SPEEDUP
from tests.unit.test_config import _error

BATCH = {"round_seconds": 16.0, "speed_spent": "batch", "inner_steps": 8}

# --- k, by hand --------------------------------------------------------------------------------


@pytest.mark.parametrize(("left", "steps", "seconds", "k"), [
    (16.0, 8, 0.125, 16),  # 16 s for 8 steps of 1/8 s batches: 16 batches each
    (16.0, 8, 0.5, 4),  # a node 4× slower: 4
    (16.0, 8, 2.0, 1),  # exactly one batch a step fits
    (16.0, 8, 3.0, 1),  # not even one: k stays 1 (next_batches ends the round early instead)
    (15.875, 7, 0.125, 18),  # ⌊15.875 / 0.875⌋ = ⌊18.14⌋
    (16.0, 8, None, 1),  # nothing measured yet: one batch measures the speed
    (16.0, 0, 0.125, 1),  # no step left: nothing to size
    (1e6, 1, 1e-3, MAX_ACCUMULATION),  # a step timed absurdly short does not make the next a round long
])
def test_k_is_the_most_batches_that_let_the_steps_left_end_by_the_deadline(left: float, steps: int,
                                                                           seconds: float | None, k: int) -> None:
    assert accumulation(left, steps, seconds) == k


def test_at_most_as_many_batches_as_a_peer_may_declare_beyond_our_round() -> None:
    # an honest node PEER_SPEEDUP× the slowest declares exactly what trust/work.py still believes
    assert MAX_ACCUMULATION == int(PEER_SPEEDUP) == 64


def run_round(clock: StepClock, start: float, end: float, steps: int, batch_seconds: float) -> tuple[list[int], float]:
    """One inner phase under --speed-spent batch on a simulated clock: each step of k batches takes k ×
    `batch_seconds`, and the clock records it per batch (as node.Node._inner_phase does). The k of
    each step and when the phase ended."""
    now, ks = start, []
    while k := next_batches(now, end, len(ks), steps, clock):
        now += k * batch_seconds
        clock.add(k * batch_seconds / k)
        ks.append(k)
    return ks, now


def test_a_node_whose_batch_time_changes_4x_between_rounds_keeps_its_h_steps_and_its_deadline() -> None:
    """T = 16 s, H = 8. Round 0 at 1/8 s a batch (nothing measured: the first step takes one batch),
    round 1 four times slower, round 2 fast again. Every round runs its 8 steps, ends by its deadline
    and fills it: k is sized again before every step from the time and steps left, and from the
    longest of the last 4 per-batch times (budget.STEP_WINDOW), so the slow round's first step still
    takes the fast k (16 batches, 8 s), and the fast round's first steps the slow one's."""
    clock = StepClock()
    fast, _ = run_round(clock, 0.0, 16.0, 8, 0.125)
    assert fast == [1, 18, 18, 18, 18, 18, 18, 19] and sum(fast) == 128  # 16 s / (1/8 s)
    slow, ended = run_round(clock, 16.0, 32.0, 8, 0.5)
    assert slow == [16, 2, 2, 2, 2, 2, 3, 3] and ended == 32.0  # 16 batches at 0.5 s, then 8 s for 7 steps
    again, ended = run_round(clock, 32.0, 48.0, 8, 0.125)
    assert again == [4, 4, 5, 5, 27, 27, 28, 28] and sum(again) == 128 and ended == 48.0


def test_two_nodes_4x_apart_run_the_same_steps_with_4x_the_batches() -> None:
    """The point of the mode: after a first round that measures, equal steps, batches in the ratio of speeds."""
    fast_clock, slow_clock = StepClock(), StepClock()
    run_round(fast_clock, 0.0, 16.0, 8, 0.125)
    run_round(slow_clock, 0.0, 16.0, 8, 0.5)
    fast, _ = run_round(fast_clock, 16.0, 32.0, 8, 0.125)
    slow, _ = run_round(slow_clock, 16.0, 32.0, 8, 0.5)
    assert len(fast) == len(slow) == 8
    assert (sum(fast), sum(slow)) == (128, 32)


def test_a_node_too_slow_for_h_batches_trains_fewer_steps_and_one_slower_still_skips() -> None:
    clock = StepClock()
    clock.add(3.0)  # 8 steps of one 3-s batch need 24 s of a 16-s round
    ks, ended = run_round(clock, 0.0, 16.0, 8, 3.0)
    assert ks == [1] * 5 and ended == 15.0  # 5 steps of k = 1, as many as fit: fewer steps, as under `steps`
    clock.add(17.0)  # one batch is longer than the round
    assert run_round(clock, 16.0, 32.0, 8, 17.0) == ([], 16.0)  # the round is skipped (node.py says so)


# --- the round loop's choice -------------------------------------------------------------------


def bare_node(cfg: NodeConfig, now: float) -> Node:
    """A Node with only what `_next_batches` reads: the config, the round, the step clock, the swarm's clock."""
    node = Node.__new__(Node)
    node.cfg, node.step_clock = cfg, StepClock()
    node.state = SimpleNamespace(round=0)  # type: ignore[assignment]
    node.parts = SimpleNamespace(swarm=SimpleNamespace(clock=lambda: now))  # type: ignore[assignment]
    return node


def test_steps_and_a_fixed_h_take_one_batch_a_step_as_before() -> None:
    fixed = bare_node(NodeConfig(inner_steps=3), 0.0)
    assert [fixed._next_batches(steps, 0.0) for steps in range(4)] == [1, 1, 1, 0]
    budget = bare_node(NodeConfig(round_seconds=16.0), 0.0)
    budget.step_clock.add(0.125)
    assert budget._next_batches(100, 16.0) == 1  # no H: one batch a step while one fits
    assert budget._next_batches(100, 0.1) == 0
    batch = bare_node(NodeConfig(**BATCH), 0.0)  # type: ignore[arg-type]
    batch.step_clock.add(0.125)
    assert batch._next_batches(0, 16.0) == 16 and batch._next_batches(8, 16.0) == 0


# --- weights, the clip and the token cap for equal steps and different batches -----------------


def group(tokens: tuple[float, ...], norms: tuple[float, ...]) -> list[Contribution]:
    """Δs along one axis each (so the mean's coordinates are each member's share times its kept norm)."""
    return [Contribution(peer, n, torch.eye(len(tokens))[index] * norm)
            for index, (peer, n, norm) in enumerate(zip("abcd"[:len(tokens)], tokens, norms, strict=True))]


UNIT = 8 * 16 * 128.0  # H × batch × seq_len: the tokens of one batch a step


def test_equal_steps_and_batches_4_2_1_1_are_capped_at_the_median_not_clipped() -> None:
    """Speeds 4:2:1:1 under batch: declarations H·k·B·L with k = 4, 2, 1, 1 and Δs of about one norm
    (same steps, same lr; a larger batch makes the Δ less noisy, not longer). The clip (1.25 × the
    median norm) does not bite; the token cap at the median declaration (the upper middle, k = 2) counts
    the 4× node as the 2× one: shares 1/3, 1/3, 1/6, 1/6; removed: the 4× node's 1/2 − 1/3 = 1/6."""
    result = aggregate(group((4 * UNIT, 2 * UNIT, UNIT, UNIT), (1.0, 1.05, 0.95, 1.0)))
    assert result.tokens == (2 * UNIT, 2 * UNIT, UNIT, UNIT)
    assert result.weights == pytest.approx((1 / 3, 1 / 3, 1 / 6, 1 / 6))
    assert result.clipped == ("a",)  # by its tokens only: every norm is within 1.25 × the median
    assert result.mean.tolist() == pytest.approx([1 / 3, 1.05 / 3, 0.95 / 6, 1 / 6])
    assert removed_share([4.0, 2.0, 1.0, 1.0], [1.0] * 4) == pytest.approx(1 / 6)


def test_the_same_speeds_spent_on_steps_lose_far_more_to_the_clip() -> None:
    """Speeds 4:2:1:1 under steps: the same declarations, with Δs of 4, 2, 1, 1 steps (norms ∝ steps
    while the steps agree in direction). ρ = 2 (the upper middle), the 4× node's Δ is clipped to 2.5:
    of Σ w·n = 0.5·4 + 0.25·2 + 0.125 + 0.125 = 2.75 the cap and the clip remove 2 − 2.5/3 = 7/6, 42 %,
    against batch's 1/6, 17 %."""
    steps = aggregate(group((4.0, 2.0, 1.0, 1.0), (4.0, 2.0, 1.0, 1.0)))
    assert steps.mean.tolist() == pytest.approx([2.5 / 3, 2 / 3, 1 / 6, 1 / 6])
    assert steps.removed == pytest.approx((7 / 6) / 2.75)
    batch = aggregate(group((4.0, 2.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0)))
    assert batch.removed == pytest.approx(1 / 6) and batch.removed < steps.removed


def test_batches_at_or_below_the_median_count_in_full() -> None:
    # 4:4:1:1: the median declaration is a 4× node's (the upper middle), so nothing is capped
    result = aggregate(group((4.0, 4.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0)))
    assert result.weights == pytest.approx((0.4, 0.4, 0.1, 0.1)) and result.clipped == () and result.removed == 0.0


def test_a_liar_among_batch_nodes_counts_at_the_median_declaration_as_under_steps() -> None:
    """The cap stays the median declaration in tokens under batch: a cap in steps would bound nothing
    (every honest node declares H steps; its batch, which is what the weight counts, is its word). A
    liar claiming any tokens with the longest Δ the clip lets through gets what it would get among
    nodes that spent the same speeds on steps: the median's tokens and 1.25 median norms."""
    honest = group((4 * UNIT, 2 * UNIT, UNIT), (1.0, 1.0, 1.0))
    liar = Contribution("x", 1e30, torch.tensor([0.0, 0.0, 0.0]) - 1e6)
    result = aggregate([*honest, liar])
    counted = dict(zip(result.used, result.tokens, strict=True))
    share = dict(zip(result.used, result.weights, strict=True))
    assert counted["x"] == 4 * UNIT  # sorted 1, 2, 4, 1e30: the upper middle
    assert share["x"] == pytest.approx(4 / 11) and "x" in result.clipped
    # its pull on the mean: its share times 1.25 ρ, ρ = 1 (the honest Δs' common norm)
    honest_part = sum(share[h.peer_id] * h.pseudo_gradient for h in honest)
    assert float((result.mean - honest_part).norm()) == pytest.approx(4 / 11 * 1.25)


# --- the config, its fingerprint and the run's manifest ----------------------------------------


def test_batch_needs_the_deadline_and_takes_h_from_inner_steps() -> None:
    assert "--round-seconds" in _error({"speed_spent": "batch"})
    assert "not both" in _error({"round_seconds": 16.0, "inner_steps": 8})  # under steps, as before
    cfg = build_config(BATCH)
    assert (cfg.inner.inner_steps, cfg.round_budget, cfg.steps_agreed) == (8, 16.0, True)
    assert cfg.round_inner_steps(0) == 8
    assert "pipeline" in _error({**BATCH, "parallel": "pipeline", "local_ranks": 2})
    assert "speed_spent" in _error({**BATCH, "speed_spent": "tokens"})


def test_batch_is_in_the_fingerprint_with_h_and_steps_is_not() -> None:
    steps, batch = NodeConfig(round_seconds=16.0), NodeConfig(**BATCH)  # type: ignore[arg-type]
    assert "speed_spent" not in steps.fingerprint_fields() and "inner_steps" not in steps.fingerprint_fields()
    assert NodeConfig(round_seconds=16.0, speed_spent="steps").fingerprint() == steps.fingerprint()
    assert batch.fingerprint_fields()["speed_spent"] == "batch" and batch.fingerprint_fields()["inner_steps"] == 8
    assert NodeConfig(**{**BATCH, "inner_steps": 9}).fingerprint() != batch.fingerprint()  # type: ignore[arg-type]


def test_the_schedule_is_the_fixed_h_one_under_batch() -> None:
    assert settings_of(NodeConfig(round_seconds=16.0, max_outer_steps=10)).total_steps == 0
    assert settings_of(NodeConfig(**BATCH, max_outer_steps=10)).total_steps == 80  # type: ignore[arg-type]
    assert not NodeConfig(round_seconds=16.0).steps_agreed and NodeConfig().steps_agreed


def test_a_batch_runs_manifest_holds_h_and_a_joiner_with_another_h_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    steps = build(NodeConfig(run_id="r", round_seconds=16.0), 1)
    assert "speed_spent" not in steps.settings and "inner_steps" not in steps.settings  # as before the option
    manifest = build(NodeConfig(run_id="r", **BATCH), 1)  # type: ignore[arg-type]
    assert manifest.settings["speed_spent"] == "batch" and manifest.settings["inner_steps"] == 8
    assert "H=8 by batch" in manifest.summary()
    assert take(manifest, {}, tmp_path).fingerprint() == manifest.fingerprint
    with pytest.raises(ManifestConflict, match="--inner-steps"):
        take(manifest, {"inner_steps": "9"}, tmp_path)
    with pytest.raises(ManifestConflict, match="--speed-spent"):
        take(steps, {"speed_spent": "batch"}, tmp_path)


# --- a step of several batches -----------------------------------------------------------------


def tiny_settings() -> ReplicaSettings:
    return ReplicaSettings(model="tiny", seed=0, data=None, seq_len=32, batch_size=4, eval_batches=1, inner_lr=1e-3,
                           warmup_steps=2, weight_decay=0.1, grad_clip=1.0, total_steps=20, precision="fp32",
                           parallel="none", devices=("cpu",), threads=1)


def stepped_gradients(trainer: InnerTrainer) -> list[list[torch.Tensor]]:
    """The (clipped) gradients each optimizer step of `trainer` is given, kept as it takes them."""
    seen: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def keep(*args: object, **kwargs: object) -> object:
        seen.append([p.grad.clone() for p in trainer.model.parameters() if p.grad is not None])
        return step(*args, **kwargs)  # type: ignore[arg-type]

    trainer.optimizer.step = keep  # type: ignore[method-assign]
    return seen


def test_a_step_of_three_batches_is_one_step_on_their_union_a_batch_per_forward() -> None:
    """The replica's step of k batches reads batches position … position + k − 1 and steps once on
    the gradient of the mean loss over all of them: the gradient a plain trainer takes from the 12
    sequences at once (up to the summation order of the pieces; AdamW's first step, ±lr per
    coordinate, would magnify that order in θ, so the gradients are compared)."""
    replica = SingleReplica(tiny_settings())
    replica.load([p.detach().clone() for p in build_model("tiny", 0).parameters()])
    ours = stepped_gradients(replica.trainer)
    batches = [replica.dataset.train_batch(4, 7, position) for position in range(3)]
    loss = replica.train_step(7, 0, batches=3)
    assert replica.trainer.step == 1 and len(ours) == 1
    plain = InnerTrainer(build_model("tiny", 0), InnerConfig(lr=1e-3, warmup_steps=2, total_steps=20))
    theirs = stepped_gradients(plain)
    union_loss = plain.train_step(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    assert loss == pytest.approx(union_loss, rel=1e-5)
    for mine, union in zip(ours[0], theirs[0], strict=True):
        assert torch.allclose(mine, union, rtol=1e-4, atol=1e-7)
    replica.close()


def test_piece_bounds_the_sequences_of_one_forward() -> None:
    seen: list[int] = []
    model = build_model("tiny", 0)
    trainer = InnerTrainer(model, InnerConfig(), lambda x: (seen.append(len(x)), model(x))[1])
    x = torch.randint(0, 256, (12, 16))
    trainer.train_step(x, x, piece=4)
    assert seen == [4, 4, 4]
    seen.clear()
    trainer.train_step(x, x)  # one batch, micro-batch 0: all at once, as before
    assert seen == [12]


# --- the learning simulator's speeds -----------------------------------------------------------


def test_the_simulator_spends_a_workers_speed_on_steps_or_on_batch() -> None:
    from harness.simulator import worker_config

    cfg = NodeConfig(inner_steps=10)
    assert (worker_config(cfg, 4, "steps")[0].inner.inner_steps, worker_config(cfg, 4, "steps")[1]) == (40, 1)
    assert (worker_config(cfg, 4, "batch")[0].inner.inner_steps, worker_config(cfg, 4, "batch")[1]) == (10, 4)
    with pytest.raises(ValueError, match="steps or batch"):
        worker_config(cfg, 2, "tokens")


def test_simulated_batch_workers_declare_their_batches_and_keep_one_phi() -> None:
    """Two workers, 2× and 1×, H = 2 under blocking: the curve counts the fast worker's tokens (2 steps
    of 2 batches a round) and both hold the same φ after every round."""
    from harness.simulator import simulate

    cfg = NodeConfig(model="tiny", seq_len=32, batch_size=4, eval_batches=1, inner_steps=2, sync="blocking",
                     threads=1, warmup_steps=2, run_id="speeds")
    curve = simulate(cfg, ["fast", "slow"], 2, speeds=(2, 1), spent="batch")
    assert [tokens for tokens, _ in curve.points] == [0, 2 * 2 * 4 * 32, 2 * 2 * 2 * 4 * 32]  # the fast worker's
    assert all(len(set(digests)) == 1 for digests in curve.digests)


def test_the_simulator_reports_what_the_trust_bounds_took_from_each_round() -> None:
    """Curve.weight_removed, one share a round (outer/aggregate.removed_share): a pair at 2× and 1×
    loses more of its declared work when the fast worker spends its speed on steps (a longer Δ, cut
    by the clip as well as the token cap) than on batch (the cap alone); an equal pair loses little.
    Weighted by tokens: under the default equal weights the cap takes nothing."""
    from harness.simulator import simulate

    cfg = NodeConfig(model="tiny", seq_len=32, batch_size=4, eval_batches=1, inner_steps=2, sync="blocking",
                     threads=1, warmup_steps=2, run_id="removed", weighting="tokens")
    shares = {spent: simulate(cfg, ["fast", "slow"], 2, evaluate=False, speeds=(2, 1), spent=spent).weight_removed
              for spent in ("steps", "batch")}
    equal = simulate(cfg, ["a", "b"], 2, evaluate=False).weight_removed
    assert all(len(s) == 2 and all(0 <= x <= 1 for x in s) for s in (*shares.values(), equal)), (shares, equal)
    assert sum(shares["batch"]) < sum(shares["steps"]), shares
    assert max(equal) < min(shares["batch"]), (equal, shares)
