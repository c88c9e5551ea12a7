"""The robust mean against hand-computed values (outer/aggregate.py)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_node.outer.aggregate import Contribution, aggregate, bounded_phi_mean


def c(peer: str, tokens: float, *values: float) -> Contribution:
    return Contribution(peer, tokens, torch.tensor(values, dtype=torch.float32))


def robust_weighted_mean(contributions: list[Contribution], own: str | None = None) -> torch.Tensor:
    return aggregate(contributions, "clip", own=own).mean


def test_token_weighted_mean_without_clipping() -> None:
    # (1·[1,0] + 1·[0,1] + 2·[1,1]) / 4; norms 1, 1, √2 are all within 4 × median (1)
    mean = robust_weighted_mean([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 2, 1, 1)])
    assert mean.tolist() == pytest.approx([0.75, 0.75])


def test_a_long_contribution_is_clipped_to_four_median_norms() -> None:
    # median norm 1 → limit 4; [100, 0] becomes [4, 0]: ([1,0] + [0,1] + [4,0]) / 3
    mean = robust_weighted_mean([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0)])
    assert mean.tolist() == pytest.approx([5 / 3, 1 / 3])


def test_the_result_does_not_depend_on_the_order_received() -> None:
    contributions = [c("a", 1, 1, 0), c("b", 3, 0, 1), c("c", 2, 7, 7)]
    assert torch.equal(robust_weighted_mean(contributions), robust_weighted_mean(contributions[::-1]))


def test_in_a_pair_the_other_is_clipped_against_our_own_norm() -> None:
    # ours [1,0] (norm 1) → limit 4; theirs [0,1000] becomes [0,4]: ([1,0] + [0,4]) / 2
    mean = robust_weighted_mean([c("us", 1, 1, 0), c("them", 1, 0, 1000)], own="us")
    assert mean.tolist() == pytest.approx([0.5, 2.0])


def test_in_a_pair_without_ours_the_smaller_norm_is_the_reference() -> None:
    # norms 3 and 40 → limit 12; [0,40] becomes [0,12]: ([3,0] + [0,12]) / 2
    mean = robust_weighted_mean([c("a", 1, 3, 0), c("b", 1, 0, 40)])
    assert mean.tolist() == pytest.approx([1.5, 6.0])


def test_an_honest_pair_clips_nothing_and_both_sides_agree() -> None:
    pair = [c("a", 1, 1, 2), c("b", 2, 3, 1)]  # norms √5 and √10: within 4× of each other
    assert torch.equal(robust_weighted_mean(pair, own="a"), robust_weighted_mean(pair, own="b"))
    assert robust_weighted_mean(pair, own="a").tolist() == pytest.approx([7 / 3, 4 / 3])


def test_non_finite_and_tokenless_contributions_are_rejected() -> None:
    mean = robust_weighted_mean([c("a", 1, math.nan, 0), c("b", 0, 5, 5), c("c", 1, 1, 1), c("d", 1, 2, 2)])
    assert mean.tolist() == pytest.approx([1.5, 1.5])
    with pytest.raises(ValueError):
        robust_weighted_mean([c("a", 1, math.inf, 0)])


def test_clipped_and_rejected_peers_are_named() -> None:
    result = aggregate([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0), c("d", 1, math.nan, 0)])
    assert result.used == ("a", "b", "c") and result.clipped == ("c",) and result.rejected == ("d",)
    assert result.reference_norm == pytest.approx(1.0)


def test_plain_mean_bounds_nothing() -> None:
    result = aggregate([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 2, 100, 0)], "mean")
    assert result.mean.tolist() == pytest.approx([50.25, 0.25]) and result.clipped == ()


def test_declared_tokens_are_capped_at_the_runs_most() -> None:
    # "c" claims 1e30 tokens: counted at the run's cap (2), like an honest node with 2
    # (norms 1, 1, 2.83: within 4 × the median) (2·[1,0] + 2·[0,1] + 2·[2,2]) / 6 = [1, 1]
    result = aggregate([c("a", 2, 1, 0), c("b", 2, 0, 1), c("c", 1e30, 2, 2)], "clip", max_tokens=2)
    assert result.mean.tolist() == pytest.approx([1.0, 1.0]) and result.clipped == ("c",)


def test_declared_tokens_count_at_most_four_typical_ones() -> None:
    # median declaration 1 → cap 4: c's 1e30 counts 4: (1·[1,0] + 1·[0,1] + 4·[2,2]) / 6
    result = aggregate([c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1e30, 2, 2)], "clip")
    assert result.mean.tolist() == pytest.approx([9 / 6, 9 / 6]) and result.clipped == ("c",)
    # a pair: the smaller declaration is the typical one, the same on both sides
    pair = [c("a", 3, 1, 0), c("b", 1e30, 0, 1)]
    assert torch.equal(aggregate(pair, own="a").mean, aggregate(pair, own="b").mean)
    assert aggregate(pair, own="a").mean.tolist() == pytest.approx([3 / 15, 12 / 15])


def test_trimmed_drops_each_coordinates_extremes() -> None:
    # five members: trim 1 per side per coordinate. Norms 1, 1, 2, 3, 50 → median 2, limit 8:
    # e scaled to [8, 0]. Coordinate 0: 0 1 2 3 8 → mean of 1 2 3 = 2; coordinate 1: 0 0 1 0 0 → 0 0 0 = 0
    members = [c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 2, 0), c("d", 1, 3, 0), c("e", 1, 50, 0)]
    result = aggregate(members, "trimmed")
    assert result.mean.tolist() == pytest.approx([2.0, 0.0]) and result.clipped == ("e",)


def test_trimmed_with_few_members_is_clip() -> None:
    members = [c("a", 1, 1, 0), c("b", 1, 0, 1), c("c", 1, 100, 0)]
    assert torch.equal(aggregate(members, "trimmed").mean, aggregate(members, "clip").mean)


def test_centered_clip_moves_the_mean_by_at_most_the_radius_per_member() -> None:
    # norms 1, 1, 1000 → reference 1, limit 4: c is scaled to [4, 0] and clip's mean is
    # ([1,0] + [1,0] + [4,0]) / 3 = [2, 0]. Then three times: each offset from the center clipped to
    # radius 1 (the reference), their mean added (first: (−1 − 1 + 1) / 3 = −1/3).
    members = [c("a", 1, 1, 0), c("b", 1, 1, 0), c("c", 1, 1000, 0)]
    center = 2.0
    for _ in range(3):
        offsets = [1 - center, 1 - center, 4 - center]
        center += sum(max(-1.0, min(1.0, o)) for o in offsets) / 3
    result = aggregate(members, "centered-clip")
    assert result.mean.tolist() == pytest.approx([center, 0.0])
    assert center < 2.0  # closer to the honest [1, 0] than clip's mean


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
