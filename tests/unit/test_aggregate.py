"""The robust mean against hand-computed values (outer/aggregate.py)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_node.outer.aggregate import Contribution, robust_weighted_mean


def c(peer: str, tokens: float, *values: float) -> Contribution:
    return Contribution(peer, tokens, torch.tensor(values, dtype=torch.float32))


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
