"""The exchange's plan at the caps (diloco_node/telemetry/planning.py)."""

from __future__ import annotations

import logging

import pytest

from diloco_node.telemetry.planning import Planner, fan_out, plan

MBIT = 125_000.0  # bytes/s


def test_fan_out_is_the_payloads_a_node_moves():
    assert fan_out(2, None) == 1
    assert fan_out(4, None) == 3  # all-gather: every other member fetches ours
    assert fan_out(4, 3) == pytest.approx(1.5)  # butterfly: 2(M − 1)/M
    assert fan_out(2, 3) == 1  # below butterfly_from: all-gather


def test_the_slower_direction_decides():
    needed = plan(10_000_000, 3, None, upload=2 * MBIT, download=10 * MBIT)
    assert needed is not None
    assert needed.seconds == pytest.approx(20_000_000 / (2 * MBIT))  # 80 s at the upload cap
    assert needed.cap == 2 * MBIT
    assert plan(10_000_000, 3, None, 0, 0) is None  # nothing capped


def test_says_it_once_with_the_numbers_and_what_to_change(caplog):
    planner = Planner(upload=2 * MBIT, download=0, butterfly_from=None, round_timeout=60)
    caplog.set_level(logging.WARNING)
    assert planner.check(75_000_000, 2, round_seconds=600) is None  # 300 s at 2 Mbit/s: fits 600 s
    line = planner.check(75_000_000, 3, round_seconds=120)  # 600 s
    assert line is not None
    for says in ("75.00 MB", "fan-out 2", "2 Mbit/s", "takes 600s", "trains 120s", "round timeout of 60s",
                 "--compression", "--fragments", "--inner-steps"):
        assert says in line
    assert planner.check(75_000_000, 3, round_seconds=120) is None  # once
    assert [r.getMessage() for r in caplog.records] == [line]


def test_the_serving_side_says_once_when_a_joiners_state_download_outlasts_a_round(caplog):
    # docs/architecture.md §14: 3.7 MB of state at 2 Mbit/s shared by 2 transfers takes ~30 s
    planner = Planner(upload=2 * MBIT, download=0, butterfly_from=None, round_timeout=60,
                      state_bytes=3_700_000, state_rate=MBIT, catch_up_rounds=10)
    assert planner.check_state(round_seconds=60) is None  # fits a round
    with caplog.at_level(logging.WARNING, logger="diloco_node.telemetry.planning"):
        line = planner.check_state(round_seconds=4)
        assert planner.check_state(round_seconds=4) is None  # once
    assert line is not None and "30s" in line and "7.4 rounds of 4s" in line and "catches up" in line
    assert caplog.text.count("serving our state") == 1
    too_long = Planner(2 * MBIT, 0, None, 60, 3_700_000, MBIT, catch_up_rounds=10).check_state(round_seconds=2)
    assert too_long is not None and "cannot take our state" in too_long
    assert Planner(0, 2 * MBIT, None, 60, 3_700_000, 0.0, 10).check_state(round_seconds=1) is None  # not serving capped


def test_a_round_without_a_group_is_not_judged():
    planner = Planner(upload=MBIT, download=MBIT, butterfly_from=None, round_timeout=60)
    assert planner.check(10 ** 9, 1, round_seconds=1) is None
    assert planner.check(10 ** 9, 0, round_seconds=1) is None
    assert not planner.told


def test_the_reporter_judges_the_group_the_exchange_was_for(caplog):
    """An exchange the cap made time out leaves only ourselves in the round's record; the plan is
    still made for the live nodes the exchange was for."""
    import torch

    from diloco_node.round import AverageResult, Outcome, Own, RoundReport
    from diloco_node.telemetry.meter import Telemetry
    from diloco_node.telemetry.rounds import RoundReporter, RoundTiming
    from tests.unit.test_record import FakeWire

    telemetry = Telemetry(run_id="r", parameters=1000, peers=3)
    planner = Planner(upload=2 * MBIT, download=0, butterfly_from=None, round_timeout=60)
    reporter = RoundReporter(telemetry, FakeWire(None), "", False, planner)  # type: ignore[arg-type]
    own = Own(payload=b"x" * 10_000_000, decoded=None, tokens=1.0, codec_seconds=0.0)
    alone = AverageResult(group=("me",), mean=torch.zeros(1), own_share=1.0, codec_seconds=0.0,
                          transfer_seconds=0.0, received_bytes=0)
    caplog.set_level(logging.WARNING)
    reporter.finished(1, [1.0], 1.0, RoundReport(Outcome.TIMEOUT, own, alone), RoundTiming(20.0, 60.0), "d", (0, 0))
    assert planner.told and "fan-out 2" in caplog.text and "takes 80s" in caplog.text
