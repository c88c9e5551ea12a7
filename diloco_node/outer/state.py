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
from diloco_node.outer.sync import MAX_IN_FLIGHT, Applied, Settled
from diloco_node.replica.layout import digest, flatten, unflatten

SharedState = tuple[dict[str, Any], list[torch.Tensor]]  # metadata; φ, momentum, our Δ of each round in flight
# φ and momentum, and our Δ of each round in flight: MAX_IN_FLIGHT of our own, as many inherited
MAX_SHARED_VECTORS = 2 + 2 * MAX_IN_FLIGHT


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

    def shared(self, fingerprint: str, server: str, settle: Callable[[], Settled | None]) -> SharedState:
        """What a joining peer downloads (on the swarm's thread): the round, φ and the momentum, flat.

        `settle` (overlapped modes) gives, under our lock, the change that makes our φ and momentum
        what they would be had every landed round's mean replaced our own Δ of that round, and the
        rounds still in flight with our Δ of each: the joiner fetches those means itself. A joiner
        must not inherit our Δ at full weight, since only we later swap it for the mean.
        """
        with self.lock:
            phi, momentum = flatten(self.phi), flatten(self.optimizer.momentum_buffers())
            metadata: dict[str, Any] = {"round": self.round, "fingerprint": fingerprint, "server": server,
                                        "has_momentum": self.optimizer.has_momentum(), "in_flight": []}
            settled = settle()
        own = []
        if settled is not None:
            phi, momentum = phi + settled.phi, momentum + settled.momentum
            metadata["in_flight"] = [{"round": a.round, "weight": a.weight, "at_step": a.at_step}
                                     for a in settled.in_flight]
            own = [a.own for a in settled.in_flight]
        return metadata, [phi, momentum, *own]

    def install_shared(self, metadata: Any, vectors: list[torch.Tensor],
                       fingerprint: str) -> tuple[str, list[Applied]] | None:
        """Install a state a peer shared, if it is well-formed, finite and of our run's config;
        returns the sharing peer and the rounds it had in flight (None when refused)."""
        if not (isinstance(metadata, dict) and isinstance(metadata.get("round"), int) and metadata["round"] >= 0
                and metadata.get("fingerprint") == fingerprint and isinstance(metadata.get("server"), str)):
            return None
        in_flight = _in_flight(metadata.get("in_flight"), vectors[2:], self.numel)
        sizes_match = len(vectors) >= 2 and all(v.dim() == 1 and v.numel() == self.numel for v in vectors[:2])
        if in_flight is None or not sizes_match or not all(torch.isfinite(v).all() for v in vectors):
            return None
        phi, momentum = unflatten(vectors[0], self.phi), unflatten(vectors[1], self.phi)
        self.install(metadata["round"], phi, momentum if metadata.get("has_momentum") else None)
        return metadata["server"], in_flight


def _in_flight(entries: Any, own: list[torch.Tensor], numel: int) -> list[Applied] | None:
    """A shared state's rounds in flight, checked: our Δ for each, its weight, the step it went in.
    A server has at most MAX_IN_FLIGHT of its own (one more after a long wait) and those it inherited."""
    if not isinstance(entries, list) or len(entries) != len(own) or len(entries) > 2 * MAX_IN_FLIGHT:
        return None
    checked = []
    for entry, delta in zip(entries, own, strict=True):
        if not (isinstance(entry, dict) and isinstance(entry.get("round"), int) and entry["round"] >= 0
                and isinstance(entry.get("weight"), float) and 0.0 <= entry["weight"] <= 1.0
                and isinstance(entry.get("at_step"), int) and entry["at_step"] <= 0
                and delta.dim() == 1 and delta.numel() == numel):
            return None
        checked.append(Applied(entry["round"], delta.float(), entry["weight"], entry["at_step"]))
    return checked
