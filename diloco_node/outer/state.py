"""φ, the outer optimizer's state and the round number: what a node shares with joiners, saves in
checkpoints and steps at the end of a round, all in the canonical layout (replica/layout.py).

One lock (`lock`) guards all three: hivemind's thread reads them for a joiner's state download
while the round engine steps them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.outer.reach import norm
from diloco_node.outer.sync import MAX_IN_FLIGHT, Applied
from diloco_node.replica.layout import digest, flatten, unflatten

logger = logging.getLogger(__name__)

SharedState = tuple[dict[str, Any], list[torch.Tensor]]  # metadata; φ and momentum, flat
MAX_SHARED_VECTORS = 2


@dataclass(frozen=True)
class Served:
    """The state we hand a joiner: the round we are at, φ and the momentum (flat), and the rounds
    before it whose means are not in φ yet; the joiner fetches those means itself (OuterUpdate.inherit)."""

    round: int
    phi: torch.Tensor
    momentum: torch.Tensor
    has_momentum: bool
    in_flight: list[int]

    def digest(self) -> str:
        """Equal on every node that serves the same state, bit for bit (records announce it)."""
        return digest([self.phi, self.momentum])

    @property
    def settled_round(self) -> int:
        """The first round whose mean is not in φ: nodes that applied the same means agree on
        (settled_round, digest) whatever round each is at."""
        return min(self.in_flight, default=self.round)


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

    def install(self, round_: int, phi: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None,
                distance: float = 0.0) -> None:
        """Replace φ and the momentum by a state `distance` from φ (outer/reach.py counts it)."""
        with self.lock:
            for mine, value in zip(self.phi, phi, strict=True):
                mine.copy_(value)
            self.optimizer.load_momentum(momentum)
            moved_on = round_ - self.round
            self.round = round_
            self.steps = 0
        self.optimizer.reach.installed(distance, moved_on)

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
                    "digest": digest(self.phi), "reach": self.optimizer.reach.saved()}

    def served(self, settled: Callable[[], Served | None]) -> Served:
        """The state a joiner gets from us: `settled` (overlapped modes: φ with only the landed
        means applied, OverlappedUpdate.served), else φ itself. Both are taken under our lock."""
        with self.lock:
            served = settled()
            if served is None:
                served = Served(self.round, flatten(self.phi), flatten(self.optimizer.momentum_buffers()),
                                self.optimizer.has_momentum(), [])
        return served

    def shared(self, fingerprint: str, server: str, settled: Callable[[], Served | None]) -> SharedState:
        """What a joining peer downloads (on the swarm's thread): the round, φ and the momentum, flat."""
        served = self.served(settled)
        metadata = {"round": served.round, "fingerprint": fingerprint, "server": server,
                    "has_momentum": served.has_momentum, "in_flight": served.in_flight}
        return metadata, [served.phi, served.momentum]

    def install_shared(self, metadata: Any, vectors: list[torch.Tensor],
                       fingerprint: str) -> tuple[str, list[Applied]] | None:
        """Install a state a peer shared, if it is well-formed, finite and of our run's config, and,
        when we hold φ of the run, no farther from ours than the rounds between can move it
        (`too_far`); returns the sharing peer and the rounds it had in flight (None when refused,
        said in one log line). Every download ends here, whatever led to it (a joiner, "behind",
        "diverged", a return from isolation): docs/architecture.md §9, "Installing a state"."""
        if not (isinstance(metadata, dict) and isinstance(metadata.get("round"), int) and metadata["round"] >= 0
                and metadata.get("fingerprint") == fingerprint and isinstance(metadata.get("server"), str)):
            logger.warning("ignored state from a peer: malformed, or from another model/config")
            return None
        in_flight = _in_flight(metadata.get("in_flight"), metadata["round"], self.numel)
        sizes_match = len(vectors) == 2 and all(v.dim() == 1 and v.numel() == self.numel for v in vectors)
        if in_flight is None or not sizes_match or not all(torch.isfinite(v).all() for v in vectors):
            logger.warning("ignored state from peer=%s: malformed or non-finite", metadata["server"][:60])
            return None
        phi, momentum = unflatten(vectors[0], self.phi), unflatten(vectors[1], self.phi)
        has_momentum = bool(metadata.get("has_momentum"))
        why, distance = self.too_far(metadata["round"], [a.round for a in in_flight], phi,
                                     momentum if has_momentum else None)
        if why is not None:
            logger.warning("refused state from peer=%s round=%d: %s (docs/architecture.md §9)",
                           metadata["server"][:60], metadata["round"], why)
            return None
        self.install(metadata["round"], phi, momentum if has_momentum else None, distance)
        return metadata["server"], in_flight

    def too_far(self, round_: int, in_flight: Sequence[int], phi: Sequence[torch.Tensor],
                momentum: Sequence[torch.Tensor] | None) -> tuple[str | None, float]:
        """Why a state at `round_` (with `in_flight` rounds not in its φ) is farther from ours than
        the rounds between can move φ under the clip (outer/reach.py), None when it is not, or when
        we hold no φ of the run yet (no outer step taken since start: a joiner keeps nothing); and
        φ's distance to it (0 when not measured).
        Checked on the received tensors before they replace φ: one peer that claims the run moved on,
        or wins a tie, can move φ by at most what honest rounds could, never replace it."""
        with self.lock:
            ours = self.round
            gap = max(abs(r - ours) for r in [round_, *in_flight])
            bound = self.optimizer.reach.bound(gap)
            if bound is None:
                return None, 0.0
            distance = math.sqrt(sum(float(torch.linalg.vector_norm(theirs - mine)) ** 2
                                     for mine, theirs in zip(self.phi, phi, strict=True)))
        buffer = norm(momentum) if momentum is not None else 0.0
        if not distance <= bound.distance:
            return (f"φ is {distance:.4g} from ours (round={ours}), beyond the {bound.distance:.4g} that "
                    f"rounds={bound.rounds} can move it under the clip, less the states installed since "
                    "our last outer step"), distance
        if not buffer <= bound.momentum:
            return (f"its momentum's norm {buffer:.4g} is beyond the {bound.momentum:.4g} our recent means "
                    "can build"), distance
        return None, distance


def _in_flight(rounds: Any, round_: int, numel: int) -> list[Applied] | None:
    """A shared state's rounds in flight, checked: rounds before `round_` whose means it lacks, at
    most what a server can have pending (its own, and those it inherited). Nothing of ours is in
    the state for them, so each mean applies whole when it lands (weight 0)."""
    if not (isinstance(rounds, list) and len(rounds) <= 2 * MAX_IN_FLIGHT
            and all(isinstance(r, int) and 0 <= r < round_ for r in rounds) and len(set(rounds)) == len(rounds)):
        return None
    return [Applied(r, torch.zeros(numel), 0.0) for r in sorted(rounds)]
