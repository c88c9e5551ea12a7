"""The OuterUpdate seam (docs/architecture.md §2): our pseudo-gradient in, the step on φ done. One implementation
per algorithm and sync mode — blocking.py, overlapped.py (delayed, eager), gossip.py (NoLoCo) — so
the round engine calls `finish_round` and never asks which one it has.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco_node.outer.fragments import Fragment, Fragments
from diloco_node.outer.state import OuterState, Served
from diloco_node.outer.sync import Applied
from diloco_node.round import AverageResult, RoundReport, Transport
from diloco_node.telemetry.meter import Telemetry


@dataclass(frozen=True)
class UpdateContext:
    """What every outer update works with."""

    state: OuterState
    # the fragments rounds exchange in turn, each with its own averaging (docs/architecture.md §15);
    # one, the whole model, without --fragments (Fragments.whole)
    fragments: Fragments
    swarm: Transport
    telemetry: Telemetry
    stop: threading.Event  # a stop was asked for: a blocking exchange gives up waiting
    abandon: threading.Event  # shutdown: a background exchange gives up waiting

    def fragment_of(self, round_: int) -> Fragment:
        """The fragment round `round_` exchanges and steps."""
        return self.fragments.of_round(round_)


class OuterUpdate(Protocol):
    def finish_round(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float) -> RoundReport:
        """Exchange our Δ of `round_` and step φ (advancing the round) as this algorithm and mode do."""

    def settle(self) -> AverageResult | None:
        """At a stop: wait for what is in flight and apply it; the last exchange applied, if any."""

    def outstanding(self) -> list[Applied]:
        """Our own Δs applied ahead of their rounds' means (overlapped modes), for the checkpoint."""

    def restore(self, outstanding: list[Applied]) -> None:
        """After a resume: those rounds' exchanges are gone, so each counts as averaged alone."""

    def forget(self) -> None:
        """φ was replaced by a peer's (re-sync): nothing in flight applies to it any more."""

    def served(self) -> Served | None:
        """Under φ's lock: the state a joiner gets from us when it is not φ itself (OuterState.served)."""

    def inherit(self, server: str, in_flight: list[Applied]) -> None:
        """After a state download: complete the rounds `server` had in flight."""


@contextlib.contextmanager
def exchanging(telemetry: Telemetry, round_: int) -> Iterator[None]:
    """`exchanging_round` in the status while this exchange runs. An abandoned exchange that ends
    late leaves the newer one's value alone."""
    telemetry.update(exchanging_round=round_)
    try:
        yield
    finally:
        telemetry.clear_if("exchanging_round", round_)


def solo_while_isolated(ctx: UpdateContext, result: AverageResult, round_: int) -> bool:
    """A mean of our own Δ alone while we are cut off from every peer: no solo step (docs/architecture.md §4)."""
    return len(result.group) <= 1 and ctx.swarm.isolated()


class NoPending:
    """For updates that finish each exchange within its round (blocking, NoLoCo)."""

    def settle(self) -> AverageResult | None:
        return None

    def outstanding(self) -> list[Applied]:
        return []

    def restore(self, outstanding: list[Applied]) -> None:
        pass

    def forget(self) -> None:
        pass

    def served(self) -> Served | None:
        return None

    def inherit(self, server: str, in_flight: list[Applied]) -> None:
        pass

