"""How far φ can move in a number of rounds, from the outer steps this node took itself
(docs/architecture.md §9, "Installing a state").

A node that holds φ of the run refuses a downloaded state farther from its own than the rounds
between them can move it. The bound is built only from what the node measured:

- each outer step records its *force*, the most the step's new input can move φ by itself: lr·‖Δ̄‖
  for DiLoCo's Nesterov SGD, α‖Δ̄‖ + γ‖φ̄ − φ‖ for NoLoCo (Δ̄ went through the robust mean, so it
  is under the clip: outer/aggregate.py);
- with forces at most F, momentum μ keeps the buffer within F/(1 − μ) and one round's move within
  F/(1 − μ) (Nesterov's g + μ·buf as well: (1 − μ + μ)/(1 − μ)), so r rounds move φ by at most
  r·F/(1 − μ), whatever the directions;
- the rounds between us and a state are its round (and the rounds it has in flight) against ours,
  but never more than our own clock allows: the time since our last outer step over the shortest
  round we measured (a server's round is its word; 2^40 rounds ahead would allow any state);
- installs count against the same bound: the distance of every state installed since our last
  outer step is taken off it, so one peer that makes us install again and again walks φ no farther
  from where our own step left it than the rounds since can move it (each install measured from
  the one before would let it walk without limit);
- slack: REACH_SLACK on F (norms grow as the inner learning rate warms up) and REACH_BASE_ROUNDS
  more rounds (a split at the same round, one-sided exchange failures, overlapped modes' early Δ).

A node resumed from a checkpoint holds the forces and times it saved (`saved`, `restore`: wall
times, so the rounds its clock allows count the time it was down). A node that has taken no outer
step of its own (a fresh joiner, or a checkpoint of an older version) has measured nothing and takes
the state as before: it has no φ of the run to keep.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

REACH_STEPS = 16  # the recent steps whose forces and pace bound the next rounds
REACH_SLACK = 2.0  # on the recent forces: Δ norms grow while the inner learning rate warms up
REACH_BASE_ROUNDS = 2  # rounds allowed on top of those between us (a split at the same round)
UNTIMED_ROUNDS = 8  # the most rounds between us before we measured the time between two steps


def norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of the tensors taken as one vector, with no copy of them."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in tensors))


@dataclass(frozen=True)
class Bound:
    """What a state may differ from ours by: φ's distance and the momentum's norm, for `rounds`."""

    rounds: int
    distance: float
    momentum: float


class Reach:
    """The forces of our recent outer steps and when they were taken (see the module's docstring)."""

    def __init__(self, momentum: float):
        self.momentum = momentum
        self._lock = threading.Lock()  # steps on the exchange thread (overlapped), installs on the round loop
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=REACH_STEPS)  # (time, move, buffer)
        self._stepped_at = -math.inf  # monotonic time of our last outer step
        self._installed = 0.0  # how far the states installed since that step moved φ, summed

    def stepped(self, move: float, buffer: float) -> None:
        """An outer step whose force was `move` in φ's units and `buffer` in the momentum buffer's."""
        with self._lock:
            now = time.monotonic()
            self._steps.append((now, move, buffer))
            self._stepped_at = now
            self._installed = 0.0

    def installed(self, distance: float) -> None:
        """φ was replaced by a state `distance` from it: that much less is left until our next step."""
        with self._lock:
            self._installed += distance

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: the recent steps (wall time, move, buffer) and the distance
        installed since the last, on the wall clock (monotonic time does not survive a restart)."""
        offset = time.time() - time.monotonic()
        with self._lock:
            return {"steps": [[at + offset, move, buffer] for at, move, buffer in self._steps],
                    "installed": self._installed}

    def restore(self, saved: Any) -> bool:
        """Take back what `saved` gave (a checkpoint's, so checked: anything else is refused whole,
        and we hold nothing measured, as a node of an older version did); whether it was taken."""
        steps = saved.get("steps") if isinstance(saved, dict) else None
        installed = saved.get("installed") if isinstance(saved, dict) else None
        if not (isinstance(steps, list) and 0 < len(steps) <= REACH_STEPS and isinstance(installed, (int, float))
                and _finite(installed)
                and all(isinstance(step, list) and len(step) == 3 and all(map(_finite, step)) for step in steps)):
            return False
        offset = time.time() - time.monotonic()
        with self._lock:
            self._steps.clear()
            self._steps.extend((at - offset, move, buffer) for at, move, buffer in steps)
            self._stepped_at = self._steps[-1][0]
            self._installed = float(installed)
        return True

    def measured(self) -> bool:
        """Whether we took an outer step since start: we hold φ of the run."""
        with self._lock:
            return bool(self._steps)

    def bound(self, gap: int) -> Bound | None:
        """The most a state `gap` rounds from ours (by its word) may differ from ours; None when we
        measured no step (see the module's docstring)."""
        with self._lock:
            if not self._steps:
                return None
            steps = list(self._steps)
            stepped_at, installed = self._stepped_at, self._installed
        times = [at for at, _, _ in steps]
        periods = [later - earlier for earlier, later in zip(times, times[1:], strict=False) if later > earlier]
        if periods:
            allowed = math.ceil((time.monotonic() - stepped_at) / min(periods)) + 1
        else:
            allowed = UNTIMED_ROUNDS
        rounds = min(max(gap, 0), allowed) + REACH_BASE_ROUNDS
        scale = REACH_SLACK / (1.0 - self.momentum)
        move = max(force for _, force, _ in steps)
        buffer = max(force for _, _, force in steps)
        return Bound(rounds, max(0.0, rounds * move * scale - installed), buffer * scale)


def _finite(value: Any) -> bool:
    """A finite number, not negative (a force, a time, a distance), and no bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
