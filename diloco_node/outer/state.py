"""φ, the outer optimizer's state and the round number: what a node shares with joiners, saves in
checkpoints and steps at the end of a round, all in the canonical layout (replica/layout.py).

One lock (`lock`) guards all three: hivemind's thread reads them for a joiner's state download
while the round engine steps them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.replica.layout import digest, flatten, unflatten


class OuterState:
    def __init__(self, phi: list[torch.Tensor], optimizer: OuterOptimizer | NoLoCoOptimizer):
        self.phi = phi  # fp32 on the CPU, canonical order; stepped in place
        self.optimizer = optimizer
        self.round = 0
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
