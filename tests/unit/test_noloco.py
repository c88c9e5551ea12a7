"""NoLoCo: the outer update against hand-computed values, the random groups, the two-part payload."""

from __future__ import annotations

import pytest
import torch

from diloco_node.codec import CodecConfig, CodecError, make_codec, split_first
from diloco_node.outer.noloco import NoLoCoOptimizer, consensus_distance
from diloco_node.swarm.groups import GROUP_BITS, group_key, random_groups


def test_update_matches_hand_computed_values() -> None:
    phi = torch.tensor([1.0, 2.0])
    outer = NoLoCoOptimizer([phi], alpha=0.7, beta=0.5, gamma=0.7)
    # Round 1: mean Δ = [0.2, -0.4], i.e. mean progress ḡ = [-0.2, 0.4]; group mean φ̄ = [1.5, 1.0].
    # m = 0.5·0 + 0.7·[-0.2, 0.4] + 0.7·([1.5, 1.0] − [1, 2]) = [0.21, -0.42];  φ = [1.21, 1.58]
    outer.step([torch.tensor([0.2, -0.4])], [torch.tensor([1.5, 1.0])])
    assert torch.allclose(outer.momentum_buffers()[0], torch.tensor([0.21, -0.42]))
    assert torch.allclose(phi, torch.tensor([1.21, 1.58]))
    # Round 2, alone (φ̄ = φ): m = 0.5·[0.21, -0.42] + 0.7·[0, -0.1] = [0.105, -0.28];  φ = [1.315, 1.30]
    outer.step([torch.tensor([0.0, 0.1])], [phi.clone()])
    assert torch.allclose(outer.momentum_buffers()[0], torch.tensor([0.105, -0.28]))
    assert torch.allclose(phi, torch.tensor([1.315, 1.30]))


def test_gamma_pulls_replicas_together() -> None:
    """Two nodes with equal progress but different φ end closer than they started."""
    a, b = torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])
    optimizers = [NoLoCoOptimizer([p], alpha=0.7, beta=0.5, gamma=0.7) for p in (a, b)]
    before = float((a - b).norm())
    mean = [(a + b) / 2]
    progress = [torch.tensor([0.1, 0.1])]
    for outer in optimizers:
        outer.step(progress, mean)
    assert float((a - b).norm()) == pytest.approx(before * (1 - 0.7))


def test_momentum_state_round_trips() -> None:
    outer = NoLoCoOptimizer([torch.zeros(3)], 0.7, 0.5, 0.7)
    assert not outer.has_momentum() and outer.state() == {"momentum": None}
    outer.step([torch.ones(3)], [torch.zeros(3)])
    saved = outer.state()
    fresh = NoLoCoOptimizer([torch.zeros(3)], 0.7, 0.5, 0.7)
    fresh.load_state(saved)
    assert fresh.has_momentum() and torch.equal(fresh.momentum_buffers()[0], torch.full((3,), -0.7))
    fresh.load_state({"momentum": None})
    assert not fresh.has_momentum() and torch.equal(fresh.momentum_buffers()[0], torch.zeros(3))


def test_consensus_distance_is_relative() -> None:
    assert consensus_distance(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])) == 0.0
    assert consensus_distance(torch.tensor([3.0, 4.5]), torch.tensor([3.0, 4.0])) == pytest.approx(0.1)


PEERS = [f"peer{i}" for i in range(7)]


@pytest.mark.parametrize(("count", "size", "sizes"), [(1, 2, [1]), (4, 2, [2, 2]), (5, 2, [2, 2, 1]),
                                                       (7, 3, [3, 2, 2]), (3, 4, [3])])
def test_groups_cover_everyone_once_and_never_exceed_the_size(count: int, size: int, sizes: list[int]) -> None:
    groups = random_groups(PEERS[:count], "run", 5, size)
    assert sorted(len(g) for g in groups) == sorted(sizes)
    assert sorted(p for g in groups for p in g) == sorted(PEERS[:count])


@pytest.mark.parametrize(("count", "size", "least", "sizes"), [
    (2, 3, 3, [2]), (4, 3, 3, [4]), (5, 3, 3, [5]), (6, 3, 3, [3, 3]), (7, 4, 3, [4, 3]), (7, 3, 3, [4, 3])])
def test_with_a_minimum_no_drawn_group_is_smaller_unless_the_run_is(count: int, size: int, least: int,
                                                                    sizes: list[int]) -> None:
    groups = random_groups(PEERS[:count], "run", 5, size, least)
    assert sorted(len(g) for g in groups) == sorted(sizes)
    assert sorted(p for g in groups for p in g) == sorted(PEERS[:count])


def test_groups_agree_across_nodes_and_change_across_rounds() -> None:
    # every node draws the same groups from the same view, whatever order it lists the peers in
    assert random_groups(PEERS[:4], "run", 3, 2) == random_groups(list(reversed(PEERS[:4])), "run", 3, 2)
    partitions = {frozenset(frozenset(g) for g in random_groups(PEERS[:4], "run", r, 2)) for r in range(20)}
    assert len(partitions) == 3  # all three ways of pairing four nodes turn up


def test_group_key_names_the_group() -> None:
    groups = [["a", "b"], ["c"]]
    assert group_key("a", groups) == group_key("b", groups) == "0" * GROUP_BITS
    assert group_key("c", groups) == "0" * (GROUP_BITS - 1) + "1"
    assert group_key("stranger", groups) == "1" * GROUP_BITS


def test_two_part_payload_splits_and_rejects_damage() -> None:
    codec, phi_codec = make_codec(CodecConfig(name="int8")), make_codec(CodecConfig(name="fp16"))
    delta, phi = torch.randn(500), torch.randn(500)
    first, second = codec.encode(delta), phi_codec.encode(phi)
    assert split_first(first + second) == (first, second)
    for damaged in (first, first[: len(first) // 2], (first + second)[:10], b"junk" * 20):
        with pytest.raises(CodecError):
            split_first(damaged)
