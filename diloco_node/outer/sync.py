"""When the exchange runs and what the outer step applies: blocking, delayed or eager (DESIGN §3).

- blocking: exchange Δ_t now, wait, apply Δ̄_t.
- delayed:  start exchanging Δ_t in the background; apply Δ̄_{t−1}, the previous round's result.
- eager:    start exchanging Δ_t in the background; apply at once the proxy
            Δ̃_t = Δ̄_{t−1} + w·(Δ_t − Δ_{t−1}). With proxy "share" (DESIGN §3), w is our share of the
            previous mean (1/M for equal tokens) and round 0, or a round after a lost exchange, applies
            Δ_t / M_expected. With proxy "full", w = 1: our fresh Δ_t stands in for the whole group's
            until Δ̄_t arrives, and the next round swaps it for the mean; round 0 applies Δ_t.
  Either way every pseudo-gradient ends up applied exactly once, with its weight in the mean; "full"
  only applies our part early at full size, which kept eager within 1 % of blocking where "share"
  lagged (benchmarks/wide_area.py, README).

Policy for a slow exchange: the node waits at most `wait_timeout` seconds for the previous round's
exchange. If it is still running, it is abandoned — its result is discarded when it arrives, so no
round is ever applied twice or out of order — and this round goes on as if that exchange had failed:
delayed applies nothing, eager applies its own fresh pseudo-gradient as in round 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

SYNC_MODES = ("blocking", "delayed", "eager")


@dataclass(frozen=True)
class Exchanged:
    """A finished exchange, as the sync policy needs it."""

    round: int
    mean: torch.Tensor  # Δ̄, flat
    own: torch.Tensor  # our contribution as peers decoded it, flat
    own_share: float  # our weight in `mean`


EAGER_PROXIES = ("full", "share")


def eager_proxy(previous: Exchanged | None, fresh: torch.Tensor, expected_group: int,
                proxy: str) -> torch.Tensor:
    """Δ̃_t = Δ̄_{t−1} + w·(Δ_t − Δ_{t−1}), w = 1 ("full") or our share s_{t−1} ("share").

    Without a previous exchange: Δ_t ("full") or Δ_t / M_expected ("share").
    """
    if proxy not in EAGER_PROXIES:
        raise ValueError(f"unknown eager proxy '{proxy}'")
    if previous is None:
        return fresh if proxy == "full" else fresh / expected_group
    weight = 1.0 if proxy == "full" else previous.own_share
    return previous.mean + (fresh - previous.own) * weight


def overlapped_step(mode: str, finished: Exchanged | None, fresh: torch.Tensor,
                    expected_group: int, proxy: str) -> torch.Tensor | None:
    """What delayed / eager apply at the end of a round, given the previous round's exchange."""
    if mode == "delayed":
        return finished.mean if finished else None
    return eager_proxy(finished, fresh, expected_group, proxy)


R = TypeVar("R")


class BackgroundExchange(Generic[R]):
    """At most one exchange collected at a time, each on its own daemon thread, by round number.

    Daemon threads, not an executor: an exchange abandoned at shutdown (waiting on a peer that is
    gone) must not keep the process alive.
    """

    def __init__(self, wait_timeout: float):
        self.wait_timeout = wait_timeout
        self._pending: tuple[int, Future[R]] | None = None
        self._lock = threading.Lock()

    def start(self, round_: int, run: Callable[[], R]) -> None:
        future: Future[R] = Future()

        def work() -> None:
            try:
                future.set_result(run())
            except BaseException as exc:  # handed to collect(), which logs it
                future.set_exception(exc)

        with self._lock:
            assert self._pending is None, "collect() the previous exchange before starting the next"
            self._pending = (round_, future)
        threading.Thread(target=work, name=f"exchange-{round_}", daemon=True).start()

    def pending_round(self) -> int | None:
        """The round of the exchange started and not yet collected, if any."""
        with self._lock:
            return self._pending[0] if self._pending is not None else None

    def in_flight(self) -> bool:
        with self._lock:
            return self._pending is not None and not self._pending[1].done()

    def collect(self, round_: int) -> R | None:
        """The result of the exchange started for `round_`, waiting at most `wait_timeout` seconds.

        None when there is none, it failed, or it timed out (then it is abandoned for good).
        """
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None or pending[0] != round_:
            return None
        try:
            return pending[1].result(timeout=self.wait_timeout)
        except FutureTimeout:
            logger.warning("round=%d exchange still running after %.0fs; abandoning it", round_, self.wait_timeout)
            pending[1].add_done_callback(lambda _: logger.info("round=%d abandoned exchange finished", round_))
        except Exception as exc:  # the exchange's own failures are logged by it; never crash the node
            logger.warning("round=%d exchange failed: %r", round_, exc)
        return None

    def close(self) -> None:
        """Drop whatever is in flight; its thread ends with the process."""
        with self._lock:
            self._pending = None
