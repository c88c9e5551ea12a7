"""The DiLoCo outer step (docs/architecture.md §3) against hand-computed numbers, plus the model digest.

Expected values are derived by hand in the comments (torch SGD semantics, nesterov=True, no
dampening): buf_1 = g_1;  buf_t = μ·buf_{t-1} + g_t;  update_t = g_t + μ·buf_t;  φ ← φ − η·update_t.
"""

from __future__ import annotations

import io

import pytest
import torch

from diloco_node.outer.diloco import OuterOptimizer, pseudo_gradient
from diloco_node.replica.layout import digest

LR, MOMENTUM = 0.7, 0.9
G1 = [0.5, -1.0]
G2 = [0.25, 0.5]
G3 = [-0.5, 0.125]


def _phi() -> torch.Tensor:
    return torch.tensor([1.0, 2.0])


def _g(values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(values)]


def _close(tensor: torch.Tensor, expected: list[float]) -> None:
    assert tensor.dtype == torch.float32
    assert tensor.tolist() == pytest.approx(expected, abs=1e-6)


def test_three_nesterov_rounds_match_hand_computation() -> None:
    phi = _phi()
    outer = OuterOptimizer([phi], lr=LR, momentum=MOMENTUM)

    # Round 1: buf = g1 = [0.5, -1.0]
    #   update = g1 + 0.9*buf = [0.5 + 0.45, -1.0 - 0.9] = [0.95, -1.9]
    #   φ = [1.0 - 0.7*0.95, 2.0 + 0.7*1.9] = [0.335, 3.33]
    outer.step(_g(G1))
    _close(phi, [0.335, 3.33])
    _close(outer.momentum_buffers()[0], [0.5, -1.0])

    # Round 2: buf = 0.9*[0.5, -1.0] + [0.25, 0.5] = [0.7, -0.4]
    #   update = [0.25 + 0.63, 0.5 - 0.36] = [0.88, 0.14]
    #   φ = [0.335 - 0.616, 3.33 - 0.098] = [-0.281, 3.232]
    outer.step(_g(G2))
    _close(phi, [-0.281, 3.232])
    _close(outer.momentum_buffers()[0], [0.7, -0.4])

    # Round 3: buf = 0.9*[0.7, -0.4] + [-0.5, 0.125] = [0.13, -0.235]
    #   update = [-0.5 + 0.117, 0.125 - 0.2115] = [-0.383, -0.0865]
    #   φ = [-0.281 + 0.2681, 3.232 + 0.06055] = [-0.0129, 3.29255]
    outer.step(_g(G3))
    _close(phi, [-0.0129, 3.29255])
    _close(outer.momentum_buffers()[0], [0.13, -0.235])


@pytest.mark.parametrize("foreach", [False, True])
def test_the_step_never_writes_into_the_mean_it_was_given(foreach: bool) -> None:
    """torch's multi-tensor Nesterov (its default on CUDA) adds the momentum into .grad in place;
    the mean must come out untouched, since eager's next proxy starts from it."""
    phi = _phi()
    outer = OuterOptimizer([phi], lr=LR, momentum=MOMENTUM, foreach=foreach)
    outer.step(_g(G1))
    second = _g(G2)
    outer.step(second)
    _close(second[0], G2)
    _close(phi, [-0.281, 3.232])  # the same as the hand computation above


def test_momentum_zero_is_plain_sgd() -> None:
    # --outer-momentum 0 is a valid setting (torch alone would refuse Nesterov without momentum):
    # φ ← φ − η·g each round, no buffer kept.
    phi = _phi()
    outer = OuterOptimizer([phi], lr=LR, momentum=0.0)
    outer.step(_g(G1))  # [1.0 - 0.35, 2.0 + 0.7] = [0.65, 2.7]
    _close(phi, [0.65, 2.7])
    outer.step(_g(G2))  # [0.65 - 0.175, 2.7 - 0.35] = [0.475, 2.35]
    _close(phi, [0.475, 2.35])
    assert outer.state() == {"momentum": None}


def test_step_updates_phi_in_place_and_leaves_no_grad_behind() -> None:
    phi = _phi()
    outer = OuterOptimizer([phi], lr=LR, momentum=MOMENTUM)
    grad = _g(G1)
    outer.step(grad)
    assert outer.params[0] is phi
    assert phi.grad is None
    assert grad[0].tolist() == G1  # the caller's pseudo-gradient is not modified


def test_several_parameters_step_independently() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])
    outer = OuterOptimizer([a, b], lr=LR, momentum=MOMENTUM)
    outer.step([torch.tensor(G1), torch.tensor([[2.0]])])
    _close(a, [0.335, 3.33])
    # b: buf = 2; update = 2 + 0.9*2 = 3.8; b = 4 - 0.7*3.8 = 1.34
    assert b.item() == pytest.approx(1.34, abs=1e-6)


def test_pseudo_gradient_is_phi_minus_theta() -> None:
    phi = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])]
    theta = [torch.tensor([0.25, 2.5], requires_grad=True), torch.tensor([[0.5]], dtype=torch.bfloat16)]
    delta = pseudo_gradient(phi, theta)
    # [1.0 - 0.25, 2.0 - 2.5] = [0.75, -0.5];  0.5 - 0.5 = 0 (bf16 θ promoted to fp32)
    _close(delta[0], [0.75, -0.5])
    assert delta[1].dtype == torch.float32 and delta[1].tolist() == [[0.0]]
    assert not delta[0].requires_grad
    assert phi[0].tolist() == [1.0, 2.0] and theta[0].tolist() == [0.25, 2.5]  # inputs untouched


def test_momentum_buffers_are_zeros_before_any_step() -> None:
    params = [torch.tensor([1.0, 2.0]), torch.ones(2, 3)]
    outer = OuterOptimizer(params, lr=LR, momentum=MOMENTUM)
    buffers = outer.momentum_buffers()
    assert [b.shape for b in buffers] == [torch.Size([2]), torch.Size([2, 3])]
    assert all(b.dtype == torch.float32 and not b.any() for b in buffers)
    assert not outer.has_momentum()
    assert outer.state() == {"momentum": None}


def test_load_momentum_none_resets_to_first_step_behaviour() -> None:
    phi = _phi()
    outer = OuterOptimizer([phi], lr=LR, momentum=MOMENTUM)
    outer.step(_g(G1))
    outer.step(_g(G2))
    assert outer.has_momentum()

    outer.load_momentum(None)
    assert not outer.has_momentum()
    assert not outer.momentum_buffers()[0].any()

    # A fresh first step from φ = [1.0, 2.0]: identical to round 1 above.
    phi.copy_(torch.tensor([1.0, 2.0]))
    outer.step(_g(G1))
    _close(phi, [0.335, 3.33])
    _close(outer.momentum_buffers()[0], [0.5, -1.0])


def test_load_momentum_installs_given_buffers_as_copies() -> None:
    phi = _phi()
    outer = OuterOptimizer([phi], lr=LR, momentum=MOMENTUM)
    given = torch.tensor([0.5, -1.0], dtype=torch.float64)
    outer.load_momentum([given])
    assert outer.has_momentum()
    # With round 1's buf = [0.5, -1.0] installed, stepping from φ = [0.335, 3.33] with g2 is round 2 above.
    phi.copy_(torch.tensor([0.335, 3.33]))
    outer.step(_g(G2))
    _close(phi, [-0.281, 3.232])
    _close(outer.momentum_buffers()[0], [0.7, -0.4])  # stored as fp32, like φ
    assert given.tolist() == [0.5, -1.0]  # the caller's tensor was copied, not stepped in place


def test_state_round_trip_continues_identically() -> None:
    phi_a = _phi()
    a = OuterOptimizer([phi_a], lr=LR, momentum=MOMENTUM)
    a.step(_g(G1))
    a.step(_g(G2))

    # Through bytes, as a checkpoint would (weights_only load like CheckpointStore.load).
    blob = io.BytesIO()
    torch.save({"phi": [phi_a.clone()], "outer": a.state()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)

    phi_b = saved["phi"][0]
    b = OuterOptimizer([phi_b], lr=LR, momentum=MOMENTUM)
    b.load_state(saved["outer"])

    a.step(_g(G3))
    b.step(_g(G3))
    assert torch.equal(phi_a, phi_b)
    assert torch.equal(a.momentum_buffers()[0], b.momentum_buffers()[0])
    _close(phi_b, [-0.0129, 3.29255])

    # Without the state, a fresh optimizer diverges: the momentum is what the round trip carried.
    phi_c = torch.tensor([-0.281, 3.232])
    c = OuterOptimizer([phi_c], lr=LR, momentum=MOMENTUM)
    c.step(_g(G3))
    assert not torch.allclose(phi_c, phi_b)


def test_state_round_trip_before_any_step() -> None:
    a = OuterOptimizer([_phi()], lr=LR, momentum=MOMENTUM)
    b = OuterOptimizer([_phi()], lr=LR, momentum=MOMENTUM)
    b.step(_g(G2))
    b.load_state(a.state())  # "no step yet" resets b's momentum
    assert not b.has_momentum()


def test_digest_equal_for_equal_tensors() -> None:
    x = [torch.tensor([1.0, 2.0, 3.0]), torch.arange(6, dtype=torch.float32).reshape(2, 3)]
    y = [t.clone() for t in x]
    assert digest(x) == digest(y)
    assert digest([x[1].t().contiguous().t()]) == digest([x[1]])  # layout does not matter, values do


def test_digest_changes_with_one_ulp() -> None:
    x = [torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 3)]
    y = [t.clone() for t in x]
    y[1][1, 2] = torch.nextafter(y[1][1, 2], torch.tensor(float("inf")))
    assert y[1][1, 2].item() != 1.0 and (y[1][1, 2] - 1.0).abs().item() < 1e-6
    assert digest(x) != digest(y)


def test_digest_tells_tensors_apart_from_their_order() -> None:
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    assert digest([a, b]) != digest([b, a])
