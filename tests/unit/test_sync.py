"""The overlapped modes' ledger (outer/sync.py) against hand-computed values (docs/architecture.md §3)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco_node.outer.sync import MAX_IN_FLIGHT, Applied, PendingExchanges, correction, fresh_weight


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_fresh_weight_per_mode_and_proxy() -> None:
    assert fresh_weight("eager", "full", None, 4) == 1.0
    assert fresh_weight("eager", "full", 0.25, 4) == 1.0
    assert fresh_weight("eager", "share", None, 4) == 0.25  # before any mean: 1/M expected
    assert fresh_weight("eager", "share", 0.75, 2) == 0.75  # then our token share of the last mean
    assert fresh_weight("delayed", "full", 0.5, 2) == 0.0
    with pytest.raises(ValueError, match="unknown eager proxy"):
        fresh_weight("eager", "half", None, 2)


def test_correction_swaps_what_we_applied_for_the_mean() -> None:
    # we applied our Δ_0 = 2 at weight 1/2; the mean (2 + 6)/2 = 4 lands: 4 − 1 = 3 (= b0/2 + a0/2)
    assert torch.equal(correction(Applied(0, t(2.0), 0.5), t(4.0)), t(3.0))
    # full proxy: 4 − 2 = 2; delayed (weight 0): the whole mean
    assert torch.equal(correction(Applied(0, t(2.0), 1.0), t(4.0)), t(2.0))
    assert torch.equal(correction(Applied(0, t(2.0), 0.0), t(4.0)), t(4.0))
    # a failed exchange counts as a round averaged alone: the rest of our own Δ
    assert torch.equal(correction(Applied(0, t(2.0), 0.5), None), t(1.0))


def run_ledger(mode: str, proxy: str, own: list[torch.Tensor], other: list[torch.Tensor],
               lands_after: dict[int, int]) -> list[torch.Tensor]:
    """Steps of one node of a two-node run: round r's mean lands at the end of round lands_after[r]
    (the next round by default; later when its exchange was slow). A last settle applies the rest."""
    steps, pending, share = [], [], None
    for round_, mine in enumerate(own):
        landed = [a for a in pending if lands_after.get(a.round, a.round + 1) <= round_]
        pending = [a for a in pending if a not in landed]
        step = sum((correction(a, (a.own + other[a.round]) / 2) for a in landed), torch.zeros_like(mine))
        share = 0.5 if landed else share
        applied = Applied(round_, mine, fresh_weight(mode, proxy, share, 2))
        pending.append(applied)
        steps.append(step + applied.weight * mine)
    steps.append(sum((correction(a, (a.own + other[a.round]) / 2) for a in pending), torch.zeros_like(own[0])))
    return steps


@pytest.mark.parametrize("mode,proxy", [("eager", "full"), ("eager", "share"), ("delayed", "full")])
@pytest.mark.parametrize("lands_after", [{}, {1: 3}])  # round 1's exchange lands two rounds late
def test_every_mean_is_applied_exactly_once(mode: str, proxy: str, lands_after: dict[int, int]) -> None:
    a = [t(1.0, 2.0), t(-3.0, 0.5), t(4.0, 4.0), t(0.5, -1.0)]
    b = [t(10.0, 20.0), t(30.0, -5.0), t(-40.0, 8.0), t(2.0, 2.0)]
    everything = sum((x + y) / 2 for x, y in zip(a, b, strict=True))
    assert torch.allclose(sum(run_ledger(mode, proxy, a, b, lands_after)), everything)
    assert torch.allclose(sum(run_ledger(mode, proxy, b, a, lands_after)), everything)


def test_eager_full_by_hand() -> None:
    a, b = [t(2.0), t(10.0)], [t(6.0), t(0.0)]
    steps = run_ledger("eager", "full", a, b, {})
    # r0: a0 = 2; r1: Δ̄_0 − a0 + a1 = 4 − 2 + 10 = 12 (docs/architecture.md §3's proxy); settle: Δ̄_1 − a1 = 5 − 10
    assert [float(s) for s in steps] == [2.0, 12.0, -5.0]


def collect(pending: PendingExchanges[str], round_: int | None, timeout: float) -> list[tuple[Applied, str | None]]:
    pending.wait(round_, timeout)
    return pending.take_finished()


def test_pending_hands_back_finished_exchanges_in_round_order_once() -> None:
    pending: PendingExchanges[str] = PendingExchanges()
    pending.start(Applied(3, t(1.0), 1.0), lambda: "three")
    taken = collect(pending, 3, timeout=5)
    assert [(a.round, r) for a, r in taken] == [(3, "three")]
    assert collect(pending, 3, timeout=0.1) == []  # consumed: never applied twice


def test_a_slow_exchange_stays_pending_and_lands_later() -> None:
    release = threading.Event()
    pending: PendingExchanges[str] = PendingExchanges()
    pending.start(Applied(1, t(1.0), 1.0), lambda: (release.wait(5), "late")[1])
    started = time.monotonic()
    assert collect(pending, 1, timeout=0.2) == []
    assert time.monotonic() - started < 4
    assert [a.round for a in pending.outstanding()] == [1]
    assert [(a.round, r) for a, r in pending.peek()] == [(1, None)]  # peeking takes nothing
    release.set()
    pending.start(Applied(2, t(2.0), 1.0), lambda: "on time")
    taken = collect(pending, 2, timeout=5)
    assert [(a.round, r) for a, r in taken] == [(1, "late"), (2, "on time")]


def test_a_failed_exchange_is_handed_back_as_none() -> None:
    def boom() -> str:
        raise RuntimeError("peer vanished")
    pending: PendingExchanges[str] = PendingExchanges()
    pending.start(Applied(2, t(1.0), 1.0), boom)
    assert [(a.round, r) for a, r in collect(pending, 2, timeout=5)] == [(2, None)]


def test_drop_forgets_everything() -> None:
    pending: PendingExchanges[str] = PendingExchanges()
    pending.start(Applied(1, t(1.0), 1.0), lambda: "x")
    pending.drop()
    assert pending.outstanding() == [] and collect(pending, None, timeout=0.1) == []


def test_exchanges_run_one_at_a_time_in_round_order() -> None:
    """hivemind matchmakes one group at a time: a later round's exchange starts after the earlier
    ones ended, so two nodes with a backlog meet round by round."""
    release = threading.Event()
    order: list[int] = []
    pending: PendingExchanges[str] = PendingExchanges()
    pending.start(Applied(1, t(1.0), 1.0), lambda: (release.wait(5), order.append(1), "one")[2])
    pending.start(Applied(2, t(1.0), 1.0), lambda: (order.append(2), "two")[1])
    assert collect(pending, 2, timeout=0.3) == [] and order == []  # round 2 waits for round 1
    release.set()
    assert [(a.round, r) for a, r in collect(pending, 2, timeout=5)] == [(1, "one"), (2, "two")]
    assert order == [1, 2]


def test_make_room_waits_for_the_oldest_when_the_pending_are_many() -> None:
    release = threading.Event()
    pending: PendingExchanges[str] = PendingExchanges()
    for round_ in range(MAX_IN_FLIGHT):
        pending.start(Applied(round_, t(1.0), 1.0), lambda: (release.wait(5), "x")[1])
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    pending.make_room(timeout=5)
    assert 0.2 < time.monotonic() - started < 4  # waited for round 0, not for the timeout
    fewer: PendingExchanges[str] = PendingExchanges()
    fewer.start(Applied(0, t(1.0), 1.0), lambda: (threading.Event().wait(2), "slow")[1])
    started = time.monotonic()
    fewer.make_room(timeout=5)
    assert time.monotonic() - started < 0.2  # room left: no wait
