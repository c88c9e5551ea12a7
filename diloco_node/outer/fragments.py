"""Streaming fragments (docs/architecture.md §15): φ cut into P fragments of whole tensors in canonical
order, one fragment exchanged and stepped per round, in turn.

Round r exchanges fragment r mod P and runs H/P inner steps, so each fragment is exchanged every P
rounds after H inner steps of drift, and one fragment moves at a time: a round's payload is about 1/P
of the model's. Between its exchanges a fragment's θ is not reset (`Drift`): the replica keeps training
it while the other fragments are exchanged, and its pseudo-gradient is taken against the φ it last
started from. P = 1 is today's round, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_node.codec import Codec
from diloco_node.outer.averaging import Averaging
from diloco_node.outer.diloco import pseudo_gradient
from diloco_node.replica.layout import unflatten


def split(numels: Sequence[int], count: int) -> list[range]:
    """`count` contiguous runs of tensor indices, each non-empty, whose largest element count is the
    least any such cut allows (the peak payload of a round is its largest fragment's).

    The least largest size C* is found by bisection (a greedy fill checks whether C fits in `count`
    runs); the runs are then filled greedily up to C*, a run closing early only where each run still
    to come needs one tensor. Deterministic: every node cuts the same way."""
    if count < 1 or count > len(numels):
        raise ValueError(f"cannot cut {len(numels)} tensors into {count} fragments")
    low, high = max(numels), sum(numels)
    while low < high:
        middle = (low + high) // 2
        if _runs_needed(numels, middle) <= count:
            high = middle
        else:
            low = middle + 1
    runs: list[range] = []
    start = size = 0
    for index, numel in enumerate(numels):
        remaining_runs = count - len(runs) - 1  # after the one being filled
        if index > start and (size + numel > low or len(numels) - index == remaining_runs):
            runs.append(range(start, index))
            start, size = index, 0
        size += numel
    runs.append(range(start, len(numels)))
    return runs


def _runs_needed(numels: Sequence[int], capacity: int) -> int:
    runs, size = 1, 0
    for numel in numels:
        if size + numel > capacity:
            runs, size = runs + 1, 0
        size += numel
    return runs


@dataclass(frozen=True)
class Fragment:
    """One fragment: the tensors `first` … `first + count − 1` of φ, at [start, end) of the flat vector,
    averaged with its own `averaging` (its own codec: an error-feedback residual is per fragment)."""

    index: int
    first: int
    count: int
    start: int
    end: int
    averaging: Averaging
    whole: bool  # the only fragment: cut() hands the vector through untouched

    @property
    def numel(self) -> int:
        return self.end - self.start

    def cut(self, flat: torch.Tensor) -> torch.Tensor:
        """This fragment's part of a flat vector of the whole model."""
        return flat if self.whole else flat[self.start:self.end]

    def tensors(self, phi: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(phi[self.first:self.first + self.count])

    def shaped(self, flat: torch.Tensor, phi: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A flat vector of this fragment as views shaped like its tensors of φ."""
        return unflatten(flat, self.tensors(phi))


class Fragments:
    """The run's P fragments; round r exchanges and steps fragment r mod P."""

    def __init__(self, numels: Sequence[int], runs: Sequence[range], averagings: Sequence[Averaging]):
        """`runs`: split(numels, P), cut once at start-up (daemon/compose.py) and shared with `Drift`."""
        bounds = [0]
        for numel in numels:
            bounds.append(bounds[-1] + numel)
        self.all = [Fragment(i, run.start, len(run), bounds[run.start], bounds[run.stop], averaging,
                             len(averagings) == 1) for i, (run, averaging) in enumerate(zip(runs, averagings,
                                                                                        strict=True))]

    @classmethod
    def whole(cls, numels: Sequence[int], averaging: Averaging) -> Fragments:
        return cls(numels, [range(len(numels))], [averaging])

    @property
    def count(self) -> int:
        return len(self.all)

    def of_round(self, round_: int) -> Fragment:
        return self.all[round_ % self.count]


class Drift:
    """θ between rounds (daemon/node.py, docs/architecture.md §15). With one fragment θ ← φ every round and
    Δ = φ − θ, as always. With P, θ is kept across rounds: at the start of a round only the fragment
    the last round ended is reloaded from φ (all of θ after a start, a resume or a re-sync), and Δ is
    taken against `origin`, the φ each fragment last started from. Overlapped modes move φ of a
    fragment after it started (a late mean's correction): that is the run's progress, not ours, and
    must not come back in our Δ, which is why Δ is not φ − θ there."""

    def __init__(self, runs: Sequence[range]):
        self.runs = list(runs)  # each fragment's tensor indices (split())
        self.theta: list[torch.Tensor] | None = None  # θ as the last inner phase left it (eval reloads φ)
        self.origin: list[torch.Tensor] = []
        self.due: range | None = None  # the tensors to reload from φ at the next start

    def start(self, phi: list[torch.Tensor]) -> list[torch.Tensor]:
        """Under φ's lock: what the replica loads for this round's inner phase."""
        if len(self.runs) == 1:
            return phi
        if self.theta is None:
            self.origin = [p.clone() for p in phi]
            self.theta = list(self.origin)
        elif self.due is not None:
            for index in self.due:
                self.origin[index] = phi[index].clone()
                self.theta[index] = self.origin[index]
        self.due = None
        return self.theta

    def delta(self, phi: list[torch.Tensor], theta: list[torch.Tensor]) -> list[torch.Tensor]:
        """Δ of the whole model after the inner phase (the round sends its fragment's part)."""
        if len(self.runs) == 1:
            return pseudo_gradient(phi, theta)
        self.theta = [t.detach().float().clone() for t in theta]
        return pseudo_gradient(self.origin, self.theta)

    def ended(self, round_: int) -> None:
        """Round `round_` is over (its fragment stepped, held or dropped): that fragment restarts from φ."""
        self.due = self.runs[round_ % len(self.runs)]

    def forget(self) -> None:
        """φ was replaced (a state download): all of θ restarts from it."""
        self.theta, self.origin, self.due = None, [], None

    def saved(self) -> dict[str, Any] | None:
        """θ and the origins for a checkpoint, so a resume keeps the other fragments' drift (§15); None
        with one fragment (θ ← φ every round) or before the first inner phase. The tensors `due` to
        be reloaded are left out: the resume reloads them from the checkpoint's φ, as the next start
        would."""
        if len(self.runs) == 1 or self.theta is None:
            return None
        due = set(self.due or ())
        return {"theta": [None if i in due else t for i, t in enumerate(self.theta)],
                "origin": [None if i in due else o for i, o in enumerate(self.origin)]}

    def restore(self, saved: Any, phi: list[torch.Tensor]) -> bool:
        """θ and the origins from `saved` (what `saved()` made, read back from a checkpoint) against the
        checkpoint's φ; False, and θ restarts from φ, when it does not fit φ (not ours, damaged)."""
        self.forget()
        if len(self.runs) == 1 or not isinstance(saved, dict):
            return False
        theta, origin = saved.get("theta"), saved.get("origin")
        if not (isinstance(theta, list) and isinstance(origin, list) and len(theta) == len(origin) == len(phi)):
            return False
        for kept in (theta, origin):
            if not all(t is None or (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                     and t.shape == p.shape and bool(torch.isfinite(t).all()))
                       for t, p in zip(kept, phi, strict=True)):
                return False
        self.origin = [p.clone() if o is None else o for o, p in zip(origin, phi, strict=True)]
        self.theta = [o if t is None else t for t, o in zip(theta, self.origin, strict=True)]
        return True


def codec_state(codecs: Sequence[Codec]) -> dict[str, Any]:
    """The codecs' state for a checkpoint: the one codec's as always, or each fragment's in order."""
    if len(codecs) == 1:
        return codecs[0].state_dict()
    return {"fragments": [codec.state_dict() for codec in codecs]}


def load_codec_state(codecs: Sequence[Codec], state: dict[str, Any]) -> None:
    """From a checkpoint of the same fingerprint (so of the same fragment count)."""
    if len(codecs) == 1:
        codecs[0].load_state_dict(state)
        return
    saved = state.get("fragments")
    for codec, part in zip(codecs, saved if isinstance(saved, list) else [{}] * len(codecs), strict=True):
        codec.load_state_dict(part)
