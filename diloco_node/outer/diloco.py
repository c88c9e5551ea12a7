"""DiLoCo's outer step (docs/architecture.md §3): Nesterov SGD on φ with the group's mean pseudo-gradient."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diloco_node.outer.reach import Reach, norm


def pseudo_gradient(outer_params: Sequence[torch.Tensor], inner_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = φ − θ: the direction the inner phase moved, signed like a gradient."""
    return [phi - theta.detach().float() for phi, theta in zip(outer_params, inner_params, strict=True)]


class OuterOptimizer:
    """torch.optim.SGD(nesterov=True) over φ, fed the averaged Δ as the gradient.

    Using torch's own SGD rather than re-deriving Nesterov keeps the semantics exactly those of
    the reference implementation (momentum buffer initialised to the first gradient, no dampening).
    """

    def __init__(self, outer_params: Sequence[torch.Tensor], lr: float, momentum: float,
                 foreach: bool | None = None):
        """`foreach` picks torch's implementation (None: its default, multi-tensor on CUDA)."""
        self.params = list(outer_params)
        self.lr, self.momentum, self.foreach = lr, momentum, foreach
        # momentum 0 (a valid setting) is plain SGD; torch refuses Nesterov without momentum
        self._sgd = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=foreach)
        # the forces of our recent steps: how far a state we download may be from φ (outer/reach.py)
        self.reach = Reach(momentum)

    @torch.no_grad()
    def step(self, mean_pseudo_gradient: Sequence[torch.Tensor], first: int = 0) -> None:
        """Step the parameters `first` … `first + len(mean_pseudo_gradient) − 1` (one fragment,
        docs/architecture.md §15; all of φ by default). SGD skips a parameter without a gradient, so
        the others neither move nor touch their momentum: the momentum is per fragment."""
        stepped = self.params[first:first + len(mean_pseudo_gradient)]
        for param, grad in zip(stepped, mean_pseudo_gradient, strict=True):
            # a copy: torch's multi-tensor Nesterov adds the momentum into .grad in place, and the
            # caller's mean is still needed (eager's next proxy starts from it)
            param.grad = grad.to(param.dtype, copy=True)
        self._sgd.step()
        for param in self.params:
            param.grad = None
        force = norm(mean_pseudo_gradient)  # the buffer takes ‖Δ̄‖, φ moves by lr·‖Δ̄‖ of it
        self.reach.stepped(self.lr * force, force)

    def copy(self, outer_params: Sequence[torch.Tensor]) -> OuterOptimizer:
        """The same optimizer, momentum included, over a copy of φ (`outer_params`)."""
        twin = OuterOptimizer(outer_params, self.lr, self.momentum, self.foreach)
        twin.load_momentum(self.momentum_buffers() if self.has_momentum() else None)
        return twin

    def momentum_buffers(self) -> list[torch.Tensor]:
        """One buffer per parameter; zeros before the first step (SGD then treats them as absent)."""
        buffers = []
        for param in self.params:
            buffer = self._sgd.state.get(param, {}).get("momentum_buffer")
            buffers.append(buffer if buffer is not None else torch.zeros_like(param))
        return buffers

    def has_momentum(self) -> bool:
        return any(self._sgd.state.get(p, {}).get("momentum_buffer") is not None for p in self.params)

    def load_momentum(self, buffers: Sequence[torch.Tensor] | None) -> None:
        """Install buffers received from a peer or a checkpoint; None means 'no step taken yet'."""
        if buffers is None:
            for param in self.params:
                self._sgd.state[param].pop("momentum_buffer", None)
            return
        for param, buffer in zip(self.params, buffers, strict=True):
            self._sgd.state[param]["momentum_buffer"] = buffer.detach().clone().to(param.dtype)

    def state(self) -> dict[str, Any]:
        return {"momentum": self.momentum_buffers() if self.has_momentum() else None}

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_momentum(state.get("momentum"))
