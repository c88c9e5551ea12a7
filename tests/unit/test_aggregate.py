"""The robust mean against hand-computed values (outer/aggregate.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from diloco_node.outer import aggregate as aggregate_module
from diloco_node.outer.aggregate import (
    Contribution,
    aggregate,
    bounded_phi_mean,
    reference_norm,
    removed_share,
    token_cap,
)
from tests.benchmark_scripts import load

CAP = load("cap_vs_attacker")  # its worst-case attacker is the measure of the bounds, here and there


def c(peer: str, tokens: float, *values: float) -> Contribution:
    return Contribution(peer, tokens, torch.tensor(values, dtype=torch.float32))


def robust_weighted_mean(contributions: list[Contribution]) -> torch.Tensor:
    return aggregate(contributions, "clip").mean


def test_token_weighted_mean_without_clipping() -> None:
    # norms 1, 1, 0.85 within 1.25 × median (1); tokens 2, 1, 2 within the median (2):
    # (2·[1,0] + 1·[0,1] + 2·[0.6,0.6]) / 5
    mean = robust_weighted_mean([c("a", 2, 1, 0), c("b", 1, 0, 1), c("c", 2, 0.6, 0.6)])
    assert mean.tolist() == pytest.approx([0.64, 0.44])


def test_the_reference_norm_is_the_middle_element_the_token_cap_takes() -> None:
    """Four nodes at speeds 1, 1, 2, 4 with Δ norms to match: ρ is the 2x node's norm, as the cap is
    its declaration; the lower median (a 1x node's) clipped the 4x node to 1.25 of the slowest."""
    assert reference_norm([4.0, 1.0, 2.0, 1.1]) == 2.0
    assert token_cap([4.0, 1.0, 2.0, 1.1], None) == 2.0
    assert reference_norm([3.0, 1.0, 2.0]) == 2.0  # odd: the one median
    assert reference_norm([5.0, 1.0]) == 1.0  # a pair: the smaller


def test_a_long_contribution_is_clipped_to_a_quarter_more_than_the_median_norm() -> None:
    # median norm 1 → limit 1.25; [100, 0] becomes [1.25, 0]: ([1,0] + [0,1] + [1.25,0]) / 3
    mean = robust_weighted_mean([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0)])
    assert mean.tolist() == pytest.approx([2.25 / 3, 1 / 3])


def test_the_result_does_not_depend_on_the_order_received() -> None:
    contributions = [c("a", 1, 1, 0), c("b", 3, 0, 1), c("c", 2, 7, 7)]
    assert torch.equal(robust_weighted_mean(contributions), robust_weighted_mean(contributions[::-1]))


def test_in_a_pair_the_longer_is_clipped_to_the_shorter_norm() -> None:
    # norms 1 and 1000 → limit 1 (the smaller norm, which both members see alike): [0,1000] → [0,1]
    mean = robust_weighted_mean([c("us", 1, 1, 0), c("them", 1, 0, 1000)])
    assert mean.tolist() == pytest.approx([0.5, 0.5])


def test_a_clip_a_little_over_the_bound_is_information_far_over_it_a_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("INFO", logger=aggregate_module.__name__)
    aggregate([c("us", 1, 1, 0), c("them", 1, 0, 1.2)])  # an honest pair: the longer Δ clipped every round
    aggregate([c("us", 1, 1, 0), c("far", 1, 0, 1000)])
    levels = {record.getMessage().split(":")[0]: record.levelno for record in caplog.records}
    assert levels == {"clipped contribution from peer=them": logging.INFO,
                      "clipped contribution from peer=far": logging.WARNING}


def test_a_cap_a_little_over_the_median_is_information_far_over_it_a_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("INFO", logger=aggregate_module.__name__)
    aggregate([c("us", 100, 1, 0), c("them", 150, 0, 1)])  # a faster honest peer under --round-seconds
    aggregate([c("us", 100, 1, 0), c("far", 10_000, 0, 1)])
    levels = {record.getMessage().split(" at ")[0]: record.levelno for record in caplog.records
              if record.getMessage().startswith("capped")}
    assert levels == {"capped the tokens of peer=them": logging.INFO,
                      "capped the tokens of peer=far": logging.WARNING}


def test_an_honest_pair_with_equal_norms_clips_nothing() -> None:
    result = aggregate([c("a", 1, 1, 2), c("b", 1, 2, 1)])
    assert result.mean.tolist() == pytest.approx([1.5, 1.5]) and result.clipped == ()


@pytest.mark.parametrize("scale", [1e3, 1.0, 0.5, 1e-3])
def test_in_a_pair_the_other_can_cancel_our_step_but_never_reverse_it(scale: float) -> None:
    ours = torch.tensor([3.0, 4.0])
    for theirs in (-scale * ours, scale * torch.tensor([-4.0, -2.9])):
        mean = aggregate([Contribution("us", 1, ours), Contribution("them", 1e30, theirs)]).mean
        assert float(mean.dot(ours)) >= -1e-6


def test_non_finite_and_tokenless_contributions_are_rejected() -> None:
    members = [c("a", 1, math.nan, 0), c("b", 0, 5, 5), c("c", 1, 1, 1), c("d", 1, 1.2, 1.2), c("e", math.inf, 1, 1)]
    result = aggregate(members)
    assert result.mean.tolist() == pytest.approx([1.0, 1.0]) and result.rejected == ("a", "b", "e")  # d clipped
    with pytest.raises(ValueError):
        robust_weighted_mean([c("a", 1, math.inf, 0)])


def test_clipped_and_rejected_peers_are_named() -> None:
    result = aggregate([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0), c("d", 1, math.nan, 0)])
    assert result.used == ("a", "b", "c") and result.clipped == ("c",) and result.rejected == ("d",)
    assert result.reference_norm == pytest.approx(1.0)


def test_plain_mean_bounds_no_norm() -> None:
    result = aggregate([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0)], "mean")
    assert result.mean.tolist() == pytest.approx([101 / 3, 1 / 3]) and result.clipped == ()


def test_declared_tokens_are_capped_at_the_runs_most() -> None:
    # "c" claims 1e30 tokens: counted at the run's cap (2), like an honest node with 2
    # (norms 1, 1, 1.13: within 1.25 × the median) (2·[1,0] + 2·[0,1] + 2·[0.8,0.8]) / 6
    result = aggregate([c("a", 2, 1, 0), c("b", 2, 0, 1), c("c", 1e30, 0.8, 0.8)], "clip", max_tokens=2)
    assert result.mean.tolist() == pytest.approx([0.6, 0.6]) and result.clipped == ("c",)


def test_declared_tokens_count_at_most_the_typical_declaration() -> None:
    # median declaration 1 → cap 1: c's 1e30 counts 1: ([1,0] + [0,1] + [0.8,0.8]) / 3
    result = aggregate([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1e30, 0.8, 0.8)], "clip")
    assert result.mean.tolist() == pytest.approx([0.6, 0.6]) and result.clipped == ("c",)
    # a pair: the smaller declaration is the typical one, the same on both sides
    assert aggregate([c("a", 3, 1, 0), c("b", 1e30, 0, 1)]).mean.tolist() == pytest.approx([0.5, 0.5])


def test_trimmed_drops_each_coordinates_extremes() -> None:
    # five members: trim 1 per side per coordinate. Norms 1, 1, 2, 3, 50 → median 2, limit 2.5:
    # d and e scaled to [2.5, 0]. Coordinate 0: 0 1 2 2.5 2.5 → mean of 1 2 2.5; coordinate 1: 0 0 0 0 1 → 0
    members = [c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 2, 0), c("d", 1, 3, 0), c("e", 1, 50, 0)]
    result = aggregate(members, "trimmed")
    assert result.mean.tolist() == pytest.approx([5.5 / 3, 0.0]) and result.clipped == ("d", "e")


def test_trimmed_with_few_members_is_clip() -> None:
    members = [c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0)]
    assert torch.equal(aggregate(members, "trimmed").mean, aggregate(members, "clip").mean)


def test_centered_clip_moves_the_mean_by_at_most_the_radius_per_member() -> None:
    # norms 1, 1, 1000 → reference 1, limit 1.25: c is scaled to [−1.25, 0] and clip's mean is
    # ([1,0] + [1,0] − [1.25,0]) / 3 = [0.25, 0]. Then three times: each offset from the center
    # clipped to radius 1 (the reference), their mean added (first: (0.75 + 0.75 − 1) / 3).
    members = [c("a", 1, 1, 0), c("b", 1, 1, 0), c("c", 1, -1000, 0)]
    center = 0.25
    for _ in range(3):
        offsets = [1 - center, 1 - center, -1.25 - center]
        center += sum(max(-1.0, min(1.0, o)) for o in offsets) / 3
    result = aggregate(members, "centered-clip")
    assert result.mean.tolist() == pytest.approx([center, 0.0])
    assert center > 0.25  # closer to the honest [1, 0] than clip's mean


def test_every_aggregator_gives_the_same_bits_on_every_node() -> None:
    members = [c("a", 1, 1, 2), c("b", 3, 0, 1), c("c", 2, 7, 7), c("d", 1, -1, 5), c("e", 2, 90, 1)]
    for method in ("mean", "clip", "trimmed", "centered-clip"):
        assert torch.equal(aggregate(members, method).mean, aggregate(members[::-1], method).mean), method


def test_an_unknown_aggregator_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown aggregator"):
        aggregate([c("a", 1, 1, 0)], "median")


def test_noloco_phi_mean_bounds_each_members_pull() -> None:
    own = torch.tensor([0.0, 0.0])
    near, far = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 100.0])
    mean, clipped = bounded_phi_mean([own, near, far], [1, 1, 2], own, radius=5.0)
    # offsets 0, [1,0], [0,5] (clipped from 100): (0 + [1,0] + 2·[0,5]) / 4 = [0.25, 2.5]
    assert mean.tolist() == pytest.approx([0.25, 2.5]) and clipped == [2]
    honest, none_clipped = bounded_phi_mean([own, near], [1, 1], own, radius=5.0)
    assert honest.tolist() == pytest.approx([0.5, 0.0]) and none_clipped == []


def test_one_attacker_that_knows_the_honest_mean_cannot_turn_the_mean_around() -> None:
    """docs/architecture.md §3, 'Bound': at M = 3 cos ≥ 0.5, at M = 8 cos ≥ 0.8 (4× clip and 4× cap: −1)."""
    assert CAP.worst_case_cosine(3) >= 0.5
    assert CAP.worst_case_cosine(8) >= 0.8


def test_among_honest_members_of_mixed_speeds_only_equal_weights_keep_the_bound() -> None:
    """#41: an attacker that claims what the fastest honest member declares sits at the median of a
    mixed group; weighted by tokens it then outweighs each honest member (at M = 3, 4:1 speeds: the
    mean reversed), equally weighted its claim buys nothing (docs/trust.md, benchmarks/results/cap_vs_attacker.md)."""
    mixed = CAP.MIXED
    assert CAP.worst_case_cosine(3, weighting="equal", speeds=mixed) >= 0.5
    assert CAP.worst_case_cosine(8, weighting="equal", speeds=mixed) >= 0.8
    assert CAP.worst_case_cosine(3, weighting="tokens", speeds=mixed) < 0, "why tokens is no default (docs/trust.md)"


def test_the_old_four_times_bounds_fail_the_same_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aggregate_module, "NORM_CLIP_MULTIPLE", 4.0)
    monkeypatch.setattr(aggregate_module, "TOKEN_CAP_MULTIPLE", 4.0)
    assert CAP.worst_case_cosine(3) < 0 and CAP.worst_case_cosine(8) < 0.5


def test_an_honest_group_of_equal_work_loses_nothing() -> None:
    group = [Contribution(p, 100.0, torch.full((4,), 1.0)) for p in "abcd"]
    assert aggregate(group).removed == 0.0


def test_a_pair_2_to_1_in_norm_loses_a_third_of_its_work() -> None:
    # the longer Δ (norm 2) is clipped to the shorter (1): of 0.5·2 + 0.5·1 = 1.5, 0.5 is gone
    pair = [Contribution("a", 10.0, torch.tensor([2.0, 0.0])), Contribution("b", 10.0, torch.tensor([0.0, 1.0]))]
    assert aggregate(pair).removed == pytest.approx(1 / 3)
    assert aggregate(pair, "mean").removed == 0.0  # no clip: nothing removed


def test_the_token_cap_removes_the_fast_nodes_share_beyond_the_median() -> None:
    # four equal Δs, one node declared 4x the tokens: its intended share 4/7, counted 1/4
    group = [Contribution(p, t, torch.ones(3)) for p, t in zip("abcd", (100.0, 100.0, 100.0, 400.0), strict=True)]
    assert aggregate(group, "mean").removed == pytest.approx(4 / 7 - 1 / 4)
    assert removed_share([100.0, 100.0, 100.0, 400.0], [1.0] * 4, "mean") == pytest.approx(4 / 7 - 1 / 4)


def test_removed_share_from_declarations_equals_the_aggregates() -> None:
    # a butterfly member computes it from an owner's report of declared tokens and whole norms
    torch.manual_seed(0)
    group = [Contribution(p, t, torch.randn(16) * s)
             for p, t, s in zip("abcde", (50.0, 80.0, 120.0, 300.0, 90.0), (1.0, 0.5, 3.0, 1.2, 0.9), strict=True)]
    for method in ("clip", "mean", "centered-clip"):
        expected = removed_share([c.tokens for c in group], [float(c.pseudo_gradient.norm()) for c in group], method)
        assert aggregate(group, method).removed == pytest.approx(expected)
        assert 0 < expected < 1
