"""Delayed and eager outer updates against hand-computed values (DESIGN §3)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco_node.outer.sync import BackgroundExchange, Exchanged, eager_proxy, overlapped_step


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_round_zero_applies_own_share_of_the_expected_group() -> None:
    assert torch.equal(eager_proxy(None, t(4.0, -2.0), expected_group=2, proxy="share"), t(2.0, -1.0))


def test_eager_proxy_swaps_our_stale_share_for_our_fresh_one() -> None:
    # Δ̄_{t-1} = (a0 + b0)/2 with a0 = 2, b0 = 6 → 4; our fresh a1 = 10; share 1/2
    # Δ̃_1 = 4 + (10 - 2)/2 = 8  ( = b0/2 + a1/2 = 3 + 5 )
    previous = Exchanged(round=0, mean=t(4.0), own=t(2.0), own_share=0.5)
    assert torch.equal(eager_proxy(previous, t(10.0), expected_group=2, proxy="share"), t(8.0))


def test_token_weighted_share() -> None:
    # mean = (3·a + 1·b)/4 with a = 4, b = 8 → 5; share 3/4; fresh 0 → 5 - 3 = 2 = b/4
    previous = Exchanged(round=0, mean=t(5.0), own=t(4.0), own_share=0.75)
    assert torch.equal(eager_proxy(previous, t(0.0), expected_group=2, proxy="share"), t(2.0))


def simulate_eager(own: list[torch.Tensor], other: list[torch.Tensor]) -> list[torch.Tensor]:
    """One node's applied proxies over the rounds of a two-node run (equal tokens)."""
    applied, previous = [], None
    for round_, (mine, theirs) in enumerate(zip(own, other, strict=True)):
        applied.append(eager_proxy(previous, mine, expected_group=2, proxy="share"))
        previous = Exchanged(round_, (mine + theirs) / 2, mine, 0.5)
    return applied


def test_every_pseudo_gradient_is_applied_exactly_once() -> None:
    a = [t(1.0, 2.0), t(-3.0, 0.5), t(4.0, 4.0)]
    b = [t(10.0, 20.0), t(30.0, -5.0), t(-40.0, 8.0)]
    applied_a, applied_b = simulate_eager(a, b), simulate_eager(b, a)
    # node A, by hand: r0 a0/2; r1 b0/2 + a1/2; r2 b1/2 + a2/2  (b2 lands with round 3)
    assert torch.equal(applied_a[0], a[0] / 2)
    assert torch.equal(applied_a[1], b[0] / 2 + a[1] / 2)
    assert torch.equal(applied_a[2], b[1] / 2 + a[2] / 2)
    # summed over the run plus the last round's late share, each Δ counts once with weight 1/2
    everything = sum((x + y) / 2 for x, y in zip(a, b, strict=True))
    assert torch.allclose(sum(applied_a) + b[2] / 2, everything)
    assert torch.allclose(sum(applied_b) + a[2] / 2, everything)


def test_full_proxy_by_hand() -> None:
    # round 0: our Δ_0 = 4 at full size; round 1: Δ̄_0 = (2 + 6)/2 = 4, ours was 2, fresh 10 → 4 + (10 − 2) = 12
    assert torch.equal(eager_proxy(None, t(4.0, -2.0), expected_group=2, proxy="full"), t(4.0, -2.0))
    previous = Exchanged(round=0, mean=t(4.0), own=t(2.0), own_share=0.5)
    assert torch.equal(eager_proxy(previous, t(10.0), expected_group=2, proxy="full"), t(12.0))
    with pytest.raises(ValueError, match="unknown eager proxy"):
        eager_proxy(previous, t(10.0), expected_group=2, proxy="half")


def test_full_proxy_applies_every_mean_exactly_once() -> None:
    a = [t(1.0, 2.0), t(-3.0, 0.5), t(4.0, 4.0)]
    b = [t(10.0, 20.0), t(30.0, -5.0), t(-40.0, 8.0)]
    applied, previous = [], None
    for round_, (mine, theirs) in enumerate(zip(a, b, strict=True)):
        applied.append(eager_proxy(previous, mine, expected_group=2, proxy="full"))
        previous = Exchanged(round_, (mine + theirs) / 2, mine, 0.5)
    # node A, by hand: r0 a0; r1 (a0+b0)/2 − a0 + a1; r2 (a1+b1)/2 − a1 + a2
    assert torch.equal(applied[1], (a[0] + b[0]) / 2 - a[0] + a[1])
    # settling at the end (the step of a round that trained nothing) swaps our stand-in a2 for
    # round 2's mean: then every round's mean was applied exactly once
    settle = eager_proxy(previous, torch.zeros_like(a[0]), expected_group=2, proxy="full")
    assert torch.equal(settle, (a[2] + b[2]) / 2 - a[2])
    everything = sum((x + y) / 2 for x, y in zip(a, b, strict=True))
    assert torch.allclose(sum(applied) + settle, everything)


def test_delayed_applies_the_previous_mean_only() -> None:
    # round 0: nothing yet; round 1: Δ̄_0 = (1 + 5)/2 = 3, whatever our fresh Δ_1 is
    assert overlapped_step("delayed", None, t(1.0), expected_group=2, proxy="share") is None
    previous = Exchanged(round=0, mean=t(3.0), own=t(1.0), own_share=0.5)
    step = overlapped_step("delayed", previous, t(100.0), expected_group=2, proxy="share")
    assert step is not None and torch.equal(step, t(3.0))


def test_eager_through_the_same_entry_point() -> None:
    previous = Exchanged(round=0, mean=t(4.0), own=t(2.0), own_share=0.5)
    step = overlapped_step("eager", previous, t(10.0), expected_group=2, proxy="share")
    assert step is not None and torch.equal(step, t(8.0))


def test_background_exchange_returns_the_matching_round_once() -> None:
    exchange: BackgroundExchange[str] = BackgroundExchange(wait_timeout=5)
    exchange.start(3, lambda: "three")
    assert exchange.collect(3) == "three"
    assert exchange.collect(3) is None  # consumed: never applied twice
    exchange.start(4, lambda: "four")
    assert exchange.collect(5) is None  # out of order: dropped, not applied
    exchange.close()


def test_a_slow_exchange_is_abandoned_after_the_timeout_and_never_returned() -> None:
    release = threading.Event()
    exchange: BackgroundExchange[str] = BackgroundExchange(wait_timeout=0.2)
    exchange.start(1, lambda: (release.wait(5), "late")[1])
    started = time.monotonic()
    assert exchange.collect(1) is None
    assert time.monotonic() - started < 4
    release.set()
    assert exchange.collect(1) is None
    exchange.close()


def test_a_failed_exchange_is_reported_as_none() -> None:
    def boom() -> str:
        raise RuntimeError("peer vanished")
    exchange: BackgroundExchange[str] = BackgroundExchange(wait_timeout=5)
    exchange.start(2, boom)
    assert exchange.collect(2) is None
    exchange.close()


def test_starting_twice_without_collecting_is_a_bug() -> None:
    exchange: BackgroundExchange[str] = BackgroundExchange(wait_timeout=5)
    exchange.start(1, lambda: "x")
    with pytest.raises(AssertionError):
        exchange.start(2, lambda: "y")
    exchange.close()
