"""The round contract: the types outer/ and swarm/ share, and the transport outer/ drives.

outer/ computes on payloads and never sees the swarm; swarm/ moves bytes and never decodes them.
What crosses between them is defined here and only here (docs/architecture.md §2):

    outer/  --Own.payload, PartSource-->  Transport (swarm/)  --Gathered-->  outer/  --RoundReport-->  node

This module imports nothing of the package but torch's tensor type, so either side may depend on it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch


class Outcome(StrEnum):
    """How a round's exchange went. A str, so that events and logs write the plain word."""

    WAITING = "waiting"  # the barrier's only: some of the group are still in their inner phase
    TOGETHER = "together"  # the group averaged
    TIMEOUT = "timeout"  # the barrier ran out: we went on with whoever was ready
    ALONE = "alone"  # nobody else in the run (or our group left): our own Δ is the mean
    LOST = "lost"  # overlapped modes: no exchange has landed to apply yet
    # our group was smaller than --min-group-size: φ takes no step from the round, which still ends
    # (docs/architecture.md §9). Every node of such a group holds alike, so their φ stays the same.
    HELD = "held"
    # φ did not step: the run moved on without us (re-sync), a stop came, or we are cut off
    BEHIND = "behind"
    STOPPED = "stopped"
    ISOLATED = "isolated"


NO_STEP = frozenset({Outcome.BEHIND, Outcome.STOPPED, Outcome.ISOLATED})


def held(group_size: int, min_group_size: int) -> bool:
    """Whether a round whose group (ourselves included) has `group_size` members takes no outer step.

    At the default minimum of 2 nothing is held: a node by itself applies its own Δ, as it always did
    (a run starts with one node). From 3 on, fewer members than the minimum, one included, hold: a
    pair, or one node averaging by itself while another trains beside it, would otherwise step φ
    apart, and a pair cannot tell an honest Δ from a lying one (docs/architecture.md §9)."""
    return min_group_size > 2 and group_size < min_group_size


# --- what a round offers ------------------------------------------------------------------------

@dataclass(frozen=True)
class Own:
    """Our contribution to a round."""

    payload: bytes | None  # what we offer; None when our Δ could not be encoded (non-finite)
    decoded: torch.Tensor | None  # flat Δ as peers decode it (so every node averages the same values)
    tokens: float
    codec_seconds: float
    # NoLoCo: our exact flat φ. Unlike Δ, the group need not agree on the mean φ to the bit, and our
    # own rounding in it would pull φ toward the codec's grid through the consensus term.
    phi: torch.Tensor | None = None
    delta: torch.Tensor | None = None  # butterfly: our exact flat Δ, whose slices we encode for their owners

    @property
    def payload_bytes(self) -> int:
        return len(self.payload) if self.payload else 0


@dataclass(frozen=True)
class PartIn:
    """One member's encoded part of its pseudo-gradient, as its owner received it."""

    peer: str
    payload: bytes  # empty: the member has nothing to contribute this round
    tokens: float
    norm: float  # the member's declared norm of its whole decoded Δ (clipping needs the whole)
    # the declared norm of each part of its decoded Δ, the same list to every owner: their squares
    # sum to norm², so a member cannot declare its whole norm to each owner (docs/architecture.md §3)
    norms: tuple[float, ...] = ()


# (round, index, every part's (start, end), parts of `index`) → (the averaged part encoded, a
# JSON-able report of what went in)
Reducer = Callable[[int, int, tuple[tuple[int, int], ...], list[PartIn]], tuple[bytes, dict[str, Any]]]


@dataclass(frozen=True)
class PartSource:
    """What we bring to a butterfly round (made by outer/averaging.py; the transport never decodes)."""

    tokens: float
    norm: float
    encode: Callable[[int, int], bytes] | None  # our Δ[start:end] encoded; None: nothing to contribute
    reduce: Reducer
    align: int  # part boundaries fall on multiples of this (the codec's blocks)
    # the norm of each part of our decoded Δ, for the given bounds (empty: nothing to contribute)
    norms: Callable[[tuple[tuple[int, int], ...]], tuple[float, ...]] = lambda bounds: ()
    numel: int = 0  # the length of the vector cut into parts: one fragment's (docs/architecture.md §15); 0: φ's


def part_bounds(numel: int, parts: int, align: int) -> tuple[tuple[int, int], ...]:
    """[start, end) of each of `parts` contiguous slices, on multiples of `align` but the last."""
    blocks = math.ceil(numel / align)
    cuts = [min(numel, align * (blocks * index // parts)) for index in range(parts + 1)]
    return tuple((cuts[i], cuts[i + 1]) for i in range(parts))


# --- what comes back ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Reduced:
    """The averaged parts of a round, by index (their bounds: part_bounds(numel, count, align)); a part
    nobody could deliver is missing."""

    group: tuple[str, ...]
    count: int
    parts: dict[int, tuple[bytes, dict[str, Any]]]  # index → (averaged part encoded, its owner's report)
    own_index: int | None  # the part we reduced (None: we own none)


@dataclass(frozen=True)
class Gathered:
    """What the transport moved for one round: the group's other payloads, undecoded."""

    outcome: Outcome  # the barrier's: together, timeout, alone (nobody else in the run), behind, stopped
    round: int = -1
    payloads: dict[str, tuple[bytes, float]] = dataclasses.field(default_factory=dict)  # peer → (payload, tokens)
    transfer_seconds: float = 0.0
    received_bytes: int = 0
    reduced: Reduced | None = None  # butterfly: the averaged parts (then `payloads` is empty)


@dataclass(frozen=True)
class AverageResult:
    group: tuple[str, ...]  # peer ids whose contributions made the mean, ourselves included
    mean: torch.Tensor  # flat Δ̄
    own_share: float  # our token weight in the mean (1/M for equal tokens)
    codec_seconds: float  # encoding ours and decoding everyone's
    transfer_seconds: float = 0.0  # fetching the others' payloads, once the group had formed
    received_bytes: int = 0  # the others' payloads we fetched
    mean_phi: torch.Tensor | None = None  # NoLoCo: the group's mean φ
    clipped: tuple[str, ...] = ()  # peers whose Δ (or φ, or declared tokens) the aggregator bounded
    rejected: tuple[str, ...] = ()  # peers whose payload was undecodable, non-finite or tokenless
    # the tokens each other member's payload declared, as it declared them (all-gather; a butterfly
    # member sees its part's owner's report only): the round loop checks them against the
    # throughput each one's record shows (budget.overclaimed)
    declared: tuple[tuple[str, float], ...] = ()
    # the share of the group's declared work the token cap and the clip took away (outer/aggregate.py,
    # removed_share): what the trust bounds cost honest peers in this round
    weight_removed: float = 0.0


@dataclass(frozen=True)
class RoundReport:
    """How a round's outer update went, for the round loop and the round's record."""

    outcome: Outcome
    own: Own | None
    result: AverageResult | None  # the exchange whose mean this round's step used
    diverged: bool = False  # blocking: our φ differs from the digest the run agrees on
    consensus_distance: float | None = None  # NoLoCo: ‖φ − φ̄‖ / ‖φ̄‖ before the step
    # delayed and eager: the round whose exchange `result` is, numbered as the round lines number
    # rounds (the round its own step made); an earlier one than this, since an exchange lands a round
    # late (a joiner's first: the server's round in flight). None: this round's own exchange
    group_round: int | None = None

    @property
    def stepped(self) -> bool:
        return self.outcome not in NO_STEP


# --- the transport ------------------------------------------------------------------------------

class Transport(Protocol):
    """What outer/ asks of the swarm in a round (implemented by swarm.Swarm)."""

    peer_id: str
    min_group_size: int  # groups smaller than this take no outer step (`held`)

    def offer(self, round_: int, payload: bytes | None, tokens: float, parts: PartSource | None = None) -> None:
        """Make our encoded contribution to `round_` fetchable by its group (None: we have none);
        `parts`: what we push and reduce if the round's group exchanges by butterfly."""

    def gather(self, round_: int, contributing: bool, stop: threading.Event,
               among: Collection[str] | None = None, on_ready: Callable[[], None] | None = None) -> Gathered:
        """The other members' payloads for `round_`, once the run (or `among`) is ready; `on_ready`
        runs between the barrier and matchmaking; `stop` ends the wait."""

    def gather_group_of(self, round_: int, member: str) -> Gathered:
        """The payloads `member`'s group averaged in `round_` (a joiner completing a round in flight)."""

    def drawn_group(self, round_: int) -> list[str]:
        """NoLoCo: who we are drawn to average with in `round_`, ourselves included."""

    def stop_sharing(self) -> None:
        """Joiners must not download our state until the round loop shares it again."""

    def mark_exchanged(self, round_: int) -> None:
        """Tell the run we have exchanged `round_` (only once φ is past it)."""

    def isolated(self) -> bool:
        """Whether we are cut off from every peer."""

    def all_past(self, round_: int) -> bool:
        """Whether every other node has gone past `round_`."""

    def peer_count(self) -> int:
        """Nodes of the run we see, ourselves included."""

    def diverged(self, round_: int, digest: str, among: Collection[str]) -> bool:
        """Whether `among` started `round_` from another φ than `digest`."""

    def served_diverged(self, among: Collection[str]) -> bool:
        """Whether the state we serve differs from the one `among` serve, settled up to the same round."""
