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
- installs count against the same bound, measured from our last outer step: the rounds each
  state installed since then moved us on are added to the rounds between, and the distance it
  moved φ is taken off, so one peer that makes us install again and again walks φ no farther from
  where our own step left it than the rounds since can move it (each install measured from the one
  before would let it walk without limit), while an honest node that re-syncs round after round
  without stepping (a slow one, always behind) is still allowed the run's whole way since;
- slack: REACH_SLACK on F (norms grow as the inner learning rate warms up) and REACH_BASE_ROUNDS
  more rounds (a split at the same round, one-sided exchange failures, overlapped modes' early Δ).

A node resumed from a checkpoint holds the forces and times it saved (`saved`, `restore`: wall
times, so the rounds its clock allows count the time it was down; a time ahead of ours is taken as
now; the installs since are not kept: a restart starts their count afresh). A node that has taken no outer
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
        self._installed_rounds = 0  # and how many rounds they moved us on, summed

    def stepped(self, move: float, buffer: float) -> None:
        """An outer step whose force was `move` in φ's units and `buffer` in the momentum buffer's."""
        with self._lock:
            now = time.monotonic()
            self._steps.append((now, move, buffer))
            self._stepped_at = now
            self._installed, self._installed_rounds = 0.0, 0

    def installed(self, distance: float, rounds: int) -> None:
        """φ was replaced by a state `distance` from it, `rounds` rounds from ours: until our next
        step, that much less distance is left, and the rounds between count from before it."""
        with self._lock:
            self._installed += distance
            self._installed_rounds += max(rounds, 0)

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: the recent steps (wall time, move, buffer), on the wall
        clock (monotonic time does not survive a restart); none before our first step."""
        offset = time.time() - time.monotonic()
        with self._lock:
            return {"steps": [[at + offset, move, buffer] for at, move, buffer in self._steps]}

    def restore(self, saved: Any) -> bool:
        """Take back what `saved` gave (a checkpoint's, so checked: anything else is refused whole,
        and we hold nothing measured, as a node of an older version did); whether it was taken. A
        time ahead of our clock (a clock set back, a hand-made file) is taken as now."""
        steps = saved.get("steps") if isinstance(saved, dict) else None
        if not (isinstance(steps, list) and len(steps) <= REACH_STEPS
                and all(isinstance(step, list) and len(step) == 3 and all(map(_finite, step)) for step in steps)):
            return False
        now, offset = time.monotonic(), time.time() - time.monotonic()
        with self._lock:
            self._steps.clear()
            self._steps.extend((min(at - offset, now), move, buffer) for at, move, buffer in sorted(steps))
            self._stepped_at = self._steps[-1][0] if self._steps else -math.inf
            self._installed, self._installed_rounds = 0.0, 0
        return True

    def measured(self) -> bool:
        """Whether we took an outer step since start: we hold φ of the run."""
        with self._lock:
            return bool(self._steps)

    def bound(self, gap: int) -> Bound | None:
        """The most a state `gap` rounds from ours (by its word) may differ from ours; None when we
        measured no step (see the module's docstring). Ours: the round we hold, which installs since
        our last step moved on (`installed`)."""
        with self._lock:
            if not self._steps:
                return None
            steps = list(self._steps)
            stepped_at, installed, installed_rounds = self._stepped_at, self._installed, self._installed_rounds
        times = [at for at, _, _ in steps]
        periods = [later - earlier for earlier, later in zip(times, times[1:], strict=False) if later > earlier]
        if periods:
            allowed = math.ceil((time.monotonic() - stepped_at) / min(periods)) + 1
        else:
            allowed = UNTIMED_ROUNDS
        rounds = min(max(gap, 0) + installed_rounds, allowed) + REACH_BASE_ROUNDS
        scale = REACH_SLACK / (1.0 - self.momentum)
        move = max(force for _, force, _ in steps)
        buffer = max(force for _, _, force in steps)
        return Bound(rounds, max(0.0, rounds * move * scale - installed), buffer * scale)


def _finite(value: Any) -> bool:
    """A finite number, not negative (a force, a time, a distance), and no bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
