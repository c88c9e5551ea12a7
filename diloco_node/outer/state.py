"""φ, the outer optimizer's state and the round number: what a node shares with joiners, saves in
checkpoints and steps at the end of a round, all in the canonical layout (replica/layout.py).

One lock (`lock`) guards all three: hivemind's thread reads them for a joiner's state download
while the round engine steps them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.replica.layout import digest, flatten, unflatten

Settle = Callable[[], tuple[torch.Tensor, torch.Tensor] | None]


class OuterState:
    def __init__(self, phi: list[torch.Tensor], optimizer: OuterOptimizer | NoLoCoOptimizer):
        self.phi = phi  # fp32 on the CPU, canonical order; stepped in place
        self.optimizer = optimizer
        self.round = 0
        self.steps = 0  # outer steps taken since start or the last install (overlapped modes' ledger)
        self.lock = threading.Lock()
        self.numel = sum(p.numel() for p in phi)

    def flat(self) -> torch.Tensor:
        with self.lock:
            return flatten(self.phi)

    def shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return unflatten(flat, self.phi)

    def digest(self) -> str:
        with self.lock:
            return digest(self.phi)

    def copy(self) -> list[torch.Tensor]:
        with self.lock:
            return [p.clone() for p in self.phi]

    def install(self, round_: int, phi: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None) -> None:
        with self.lock:
            for mine, value in zip(self.phi, phi, strict=True):
                mine.copy_(value)
            self.optimizer.load_momentum(momentum)
            self.round = round_
            self.steps = 0

    def momentum(self) -> list[torch.Tensor] | None:
        """A copy of the outer momentum, None before the first step."""
        with self.lock:
            if not self.optimizer.has_momentum():
                return None
            return [m.clone() for m in self.optimizer.momentum_buffers()]

    def saved(self) -> dict[str, Any]:
        """The checkpoint's outer part."""
        with self.lock:
            return {"round": self.round, "outer_params": [p.clone() for p in self.phi],
                    "momentum": ([m.clone() for m in self.optimizer.momentum_buffers()]
                                 if self.optimizer.has_momentum() else None),
                    "digest": digest(self.phi)}

    def shared(self, fingerprint: str, settle: Settle | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining peer downloads (on hivemind's thread): the round, φ and the momentum.

        `settle` (overlapped modes) gives, under our lock, the change that turns our φ and momentum
        into what they would be had every round's mean already replaced our own Δ of that round:
        a joiner must not inherit our Δ at full weight, since only we later swap it for the mean.
        """
        with self.lock:
            metadata = {"round": self.round, "fingerprint": fingerprint,
                        "has_momentum": self.optimizer.has_momentum()}
            phi = flatten(self.phi)
            momentum = flatten(self.optimizer.momentum_buffers())
            change = settle() if settle is not None else None
        if change is not None:
            phi, momentum = phi + change[0], momentum + change[1]
        return metadata, unflatten(phi, self.phi) + unflatten(momentum, self.phi)

    def install_shared(self, metadata: Any, tensors: list[torch.Tensor], fingerprint: str) -> bool:
        """Install a state a peer shared, if it is well-formed, finite and of our run's config."""
        n = len(self.phi)
        shapes_match = len(tensors) == 2 * n and all(
            t.shape == p.shape for t, p in zip(tensors, self.phi + self.phi, strict=True))
        well_formed = (isinstance(metadata, dict) and isinstance(metadata.get("round"), int)
                       and metadata["round"] >= 0 and metadata.get("fingerprint") == fingerprint)
        if not (well_formed and shapes_match and all(torch.isfinite(t).all() for t in tensors)):
            return False
        self.install(int(metadata["round"]), tensors[:n], tensors[n:] if metadata.get("has_momentum") else None)
        return True
