"""When the exchange runs and what an overlapped outer step applies (docs/architecture.md §3).

- blocking: exchange Δ_t now, wait, apply Δ̄_t (outer/blocking.py).
- delayed:  start exchanging Δ_t in the background; apply the means that have arrived since.
- eager:    start exchanging Δ_t in the background; apply at once our fresh Δ_t with weight w_t
            (proxy "full": w = 1, it stands in for the whole group's mean; "share": w = our
            token share of the last mean, 1/M_expected before any) plus, for every exchange that
            has finished since, the swap of what we applied for the group's mean.

Both follow one ledger. Each round records what it applied of our own Δ (`Applied`: the decoded
Δ and its weight; delayed's weight is 0). When round r's mean Δ̄_r arrives, whenever that is, the
step applies Δ̄_r − w_r·Δ_r. So over a run the steps add up to Σ_r Δ̄_r, every pseudo-gradient
exactly once with its weight in the mean: also when our own encode failed (Δ_r = 0, the others'
mean still applies), when an exchange is slower than `sync_timeout` (it stays pending and is
applied when it lands, instead of being dropped), and when one fails (the round then averaged
alone: Δ̄_r = Δ_r). With w = 1 and the previous exchange finished, the step is
Δ̄_{t−1} + (Δ_t − Δ_{t−1}), the eager proxy of docs/architecture.md §3.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

SYNC_MODES = ("blocking", "delayed", "eager")
EAGER_PROXIES = ("full", "share")


@dataclass(frozen=True)
class Applied:
    """Our own Δ of a round as an overlapped step already applied it, until the round's mean lands."""

    round: int
    own: torch.Tensor  # flat, as peers decode it; zeros when ours could not be sent
    weight: float
    at_step: int = 0  # OuterState.steps once the step that applied it was taken


def fresh_weight(mode: str, proxy: str, last_share: float | None, expected_group: int) -> float:
    """w_t: how much of our fresh Δ_t this round's step applies before the group's mean is known."""
    if mode == "delayed":
        return 0.0
    if proxy not in EAGER_PROXIES:
        raise ValueError(f"unknown eager proxy '{proxy}'")
    if proxy == "full":
        return 1.0
    return last_share if last_share is not None else 1.0 / max(expected_group, 1)


def correction(applied: Applied, mean: torch.Tensor | None) -> torch.Tensor:
    """Δ̄_r − w_r·Δ_r; a failed exchange (no mean) counts as a round averaged alone (Δ̄_r = Δ_r)."""
    return (mean if mean is not None else applied.own) - applied.weight * applied.own


R = TypeVar("R")


# Exchanges a node keeps pending at once: the one it just started and one still running late.
# Beyond that the round engine waits for the oldest: when exchanges take longer than rounds, a
# longer queue only grows, and its rounds' payloads would be gone (swarm/exchange.py keeps offers
# a few rounds) by the time their turn came.
MAX_IN_FLIGHT = 2


class PendingExchanges(Generic[R]):
    """Exchanges started in the background, each on its own daemon thread, with what we applied of
    our own Δ for each. Daemon threads, not an executor: an exchange still waiting on a peer that is
    gone at shutdown must not keep the process alive. Guarded by `_lock` (round engine and settling).

    They run one at a time, in round order: hivemind matchmakes one group at a time per node, so
    exchanges started while others still run (after a peer froze) would each look for their own
    round's group while the peer looks for another's, fail, and leave the next ones as far behind.
    In order, both sides meet round by round and catch up.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[Applied, Future[R]]] = {}
        self._lock = threading.Lock()

    def make_room(self, timeout: float) -> None:
        """While MAX_IN_FLIGHT exchanges are pending, wait up to `timeout` for the oldest to end."""
        with self._lock:
            futures = [future for _, (_, future) in sorted(self._pending.items())]
        excess = len(futures) - MAX_IN_FLIGHT + 1
        if excess > 0 and wait(futures[:excess], timeout=timeout).not_done:
            logger.warning("%d exchanges pending after %.0fs; starting one more", len(futures), timeout)

    def start(self, applied: Applied, run: Callable[[], R]) -> None:
        """Run `run` on its own thread once the exchanges started before it have ended."""
        future: Future[R] = Future()
        with self._lock:
            before = [f for _, f in self._pending.values()]
            self._pending[applied.round] = (applied, future)

        def work() -> None:
            wait(before)
            try:
                future.set_result(run())
            except BaseException as exc:  # handed to take_finished(), which logs it
                future.set_exception(exc)

        threading.Thread(target=work, name=f"exchange-{applied.round}", daemon=True).start()

    def wait(self, round_: int | None, timeout: float) -> None:
        """Wait up to `timeout` for the exchange of `round_` (all of them when None). One still
        running stays pending and is handed over when it lands (logged once here)."""
        with self._lock:
            waited = [f for r, (_, f) in self._pending.items() if round_ is None or r == round_]
        _, running = wait(waited, timeout=timeout)
        if running:
            logger.warning("exchange still running after %.1fs; it is applied when it lands", timeout)

    def take_finished(self) -> list[tuple[Applied, R | None]]:
        """Every finished exchange, in round order, handed over once (None for a failed one)."""
        with self._lock:
            finished = sorted(r for r, (_, f) in self._pending.items() if f.done())
            taken = [self._pending.pop(r) for r in finished]
        return [(applied, _result(applied.round, future)) for applied, future in taken]

    def peek(self) -> list[tuple[Applied, R | None]]:
        """Everything pending, in round order, with the result of those that finished (not taken)."""
        with self._lock:
            entries = sorted(self._pending.items())
        return [(applied, _result(applied.round, future) if future.done() else None)
                for _, (applied, future) in entries]

    def outstanding(self) -> list[Applied]:
        with self._lock:
            return [applied for _, (applied, _) in sorted(self._pending.items())]

    def in_flight(self) -> bool:
        with self._lock:
            return any(not future.done() for _, future in self._pending.values())

    def drop(self) -> dict[int, Future[R]]:
        """Forget everything pending (a re-sync replaced φ, or shutdown); threads end with the process.
        Returns the dropped exchanges by round: one still running ends with its group's mean."""
        with self._lock:
            dropped = {round_: future for round_, (_, future) in self._pending.items()}
            self._pending.clear()
        return dropped


def _result(round_: int, future: Future[R]) -> R | None:
    try:
        return future.result(timeout=0)
    except FutureTimeout:  # cannot happen: only finished futures are read
        return None
    except Exception as exc:  # the exchange's own failures are logged by it; never crash the node
        logger.warning("round=%d exchange failed: %r", round_, exc)
        return None
