"""NoLoCo's outer step (docs/architecture.md §3): momentum on the group's mean progress plus a pull towards
the group's mean φ. There is no all-reduce, so replicas differ; the pull keeps them close.

With g = θ − φ (local progress, i.e. −Δ) and means over the group:

    m ← β·m + α·ḡ + γ·(φ̄ − φ);   φ ← φ + m
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from diloco_node.outer.reach import Reach, norm


class NoLoCoOptimizer:
    """Same state interface as OuterOptimizer, so checkpoints and state sharing treat both alike."""

    def __init__(self, outer_params: Sequence[torch.Tensor], alpha: float, beta: float, gamma: float):
        self.params = list(outer_params)
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self._momentum = [torch.zeros_like(p) for p in self.params]
        self._stepped = False
        # the forces of our recent steps: how far a state we download may be from φ (outer/reach.py)
        self.reach = Reach(beta)

    @torch.no_grad()
    def step(self, mean_pseudo_gradient: Sequence[torch.Tensor], mean_phi: Sequence[torch.Tensor],
             first: int = 0) -> None:
        """One update from the group's mean Δ (= −ḡ) and mean φ; φ is updated in place. Only the
        parameters from `first` on that the means cover move, and only their momentum (one fragment,
        docs/architecture.md §15)."""
        end = first + len(mean_pseudo_gradient)
        pull = 0.0  # ‖φ̄ − φ‖², for the step's force
        for phi, momentum, delta, phi_bar in zip(self.params[first:end], self._momentum[first:end],
                                                 mean_pseudo_gradient, mean_phi, strict=True):
            towards = phi_bar - phi
            pull += float(torch.linalg.vector_norm(towards)) ** 2
            momentum.mul_(self.beta).add_(delta, alpha=-self.alpha).add_(towards, alpha=self.gamma)
            phi.add_(momentum)
        self._stepped = True
        # at most α‖Δ̄‖ + γ‖φ̄ − φ‖ enters the momentum, which is φ's move itself (outer/reach.py)
        force = self.alpha * norm(mean_pseudo_gradient) + self.gamma * math.sqrt(pull)
        self.reach.stepped(force, force)

    def momentum_buffers(self) -> list[torch.Tensor]:
        return self._momentum

    def has_momentum(self) -> bool:
        return self._stepped

    def load_momentum(self, buffers: Sequence[torch.Tensor] | None) -> None:
        self._stepped = buffers is not None
        for momentum, value in zip(self._momentum, buffers or [torch.zeros_like(p) for p in self.params],
                                   strict=True):
            momentum.copy_(value)

    def state(self) -> dict[str, Any]:
        return {"momentum": self.momentum_buffers() if self.has_momentum() else None}

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_momentum(state.get("momentum"))


def consensus_distance(phi: torch.Tensor, mean_phi: torch.Tensor) -> float:
    """‖φ − φ̄‖ / ‖φ̄‖: how far this node's φ is from its group's mean, relative to φ's size."""
    return float((phi - mean_phi).norm() / mean_phi.norm().clamp_min(1e-12))
