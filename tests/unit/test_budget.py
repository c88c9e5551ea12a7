"""Rounds by time budget (docs/architecture.md §13): the deadlines on the swarm's clock, when a step
still fits, the barrier's wait, the learning-rate schedule when step counts differ, the config, and
each node's weight in the mean (`--weighting`)."""

from __future__ import annotations

import math

import pytest

from diloco_node.config import build_config
from diloco_node.daemon.budget import BARRIER_FLOOR, MIN_SHARE, StepClock, barrier_timeout, deadline, warmup_pace
from diloco_node.round import Outcome
from diloco_node.train.inner import InnerConfig, budget_lr_at, lr_at
from tests.unit.test_config import _error

# --- deadlines ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("now", "seconds", "expected"), [
    (100.0, 10.0, 110.0),  # on a grid point: the next one, a whole T away
    (101.0, 10.0, 110.0),  # 9 s left ≥ T/4
    (107.5, 10.0, 110.0),  # exactly T/4 left: still this one
    (107.6, 10.0, 120.0),  # less than T/4 left: the one after
    (1_795_000_003.2, 4.0, 1_795_000_008.0),  # Unix times: 4.8 s left (the grid point at …004 is 0.8 s away)
    (0.0, 0.5, 0.5),
])
def test_deadline_is_the_first_grid_point_at_least_a_quarter_round_away(now: float, seconds: float,
                                                                         expected: float) -> None:
    assert MIN_SHARE == 0.25
    end = deadline(now, seconds)
    assert end == pytest.approx(expected, abs=1e-6)
    assert MIN_SHARE * seconds - 1e-9 <= end - now <= (1 + MIN_SHARE) * seconds + 1e-9


def test_nodes_that_start_apart_within_a_round_share_its_deadline() -> None:
    """Two nodes that ended the exchange 0.9 s apart (different clocks of the same swarm time) stop
    together: the deadline is a grid point of the swarm's clock, not 'now + T'."""
    assert deadline(1_000_000_000.2, 5.0) == deadline(1_000_000_001.1, 5.0) == 1_000_000_005.0
    # and every later round of either lands on the same grid, T apart
    assert deadline(1_000_000_005.3, 5.0) - deadline(1_000_000_000.2, 5.0) == 5.0


def test_barrier_waits_a_round_at_least_the_floor_at_most_the_round_timeout() -> None:
    assert barrier_timeout(30.0, 60.0) == 30.0
    assert barrier_timeout(1.0, 60.0) == BARRIER_FLOOR == 2.0
    assert barrier_timeout(300.0, 60.0) == 60.0


# --- steps that fit ----------------------------------------------------------------------------


def test_first_step_is_tried_then_the_longest_recent_step_decides() -> None:
    clock = StepClock(window=3)
    assert clock.estimate() is None
    assert clock.fits(now=9.99, end=10.0)  # nothing timed yet: try one (it measures our speed)
    assert not clock.fits(now=10.0, end=10.0)  # but never past the deadline
    for seconds in (0.5, 2.0, 1.0):
        clock.add(seconds)
    assert clock.estimate() == 2.0
    assert clock.fits(now=8.0, end=10.0) and not clock.fits(now=8.01, end=10.0)
    clock.add(0.5)  # the 2 s step drops out of a window of 3: a node that sped up gets more steps
    clock.add(0.5)
    assert clock.estimate() == 1.0
    clock.add(4.0)  # slowed down 4×: the next step is estimated at once at the slow speed
    assert clock.estimate() == 4.0 and not clock.fits(now=7.0, end=10.0)


def test_a_skipped_round_forgets_the_step_times() -> None:
    clock = StepClock()
    clock.add(30.0)  # a step timed while the process was stopped
    assert not clock.fits(now=0.0, end=10.0)
    clock.forget()
    assert clock.estimate() is None and clock.fits(now=0.0, end=10.0)


# --- the schedule --------------------------------------------------------------------------------


CFG = InnerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)


@pytest.mark.parametrize(("step", "progress", "expected"), [
    (0, 0.0, 1e-4),  # first step: lr/W, the cosine at its top
    (4, 0.0, 5e-4),
    (9, 0.0, 1e-3),  # warmup done at step W − 1, as lr_at
    (500, 0.0, 1e-3),
    (500, 0.5, 1e-3 * (0.1 + 0.9 * 0.5)),  # half way: the middle of the cosine, 5.5e-4
    (500, 1.0, 1e-4),  # the floor at the end of the run
    (500, 3.0, 1e-4),  # past the end: stays at the floor
    (4, 0.5, 0.5 * 5.5e-4),  # a joiner half way through the run still warms its own moments
])
def test_budget_lr_hand_values(step: int, progress: float, expected: float) -> None:
    assert budget_lr_at(step, progress, CFG) == pytest.approx(expected, rel=1e-12)


def test_budget_lr_is_the_same_for_fast_and_slow_nodes_at_the_same_round() -> None:
    """A node of 4× the speed takes 4× the steps per round; past warmup both use one lr per round, so
    the fast node does not race through the decay (indexed by steps, it would reach the floor at a
    quarter of the run)."""
    rounds, slow, fast = 8, 20, 80
    for round_ in range(1, rounds):
        progress = round_ / rounds
        assert budget_lr_at(round_ * slow, progress, CFG) == budget_lr_at(round_ * fast, progress, CFG)
    by_steps = InnerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, total_steps=rounds * slow)
    assert lr_at(2 * fast, by_steps) == pytest.approx(1e-4)  # what indexing by steps would have done at round 2
    assert budget_lr_at(2 * fast, 2 / rounds, CFG) > 8e-4


def test_budget_lr_without_a_run_length_is_constant_after_warmup() -> None:
    no_warmup = InnerConfig(lr=2e-3, warmup_steps=0)
    assert budget_lr_at(0, 0.0, no_warmup) == 2e-3
    assert [budget_lr_at(s, 0.0, CFG) for s in (10, 1000, 10**6)] == [1e-3] * 3


# --- config --------------------------------------------------------------------------------------



@pytest.mark.parametrize("value", [0, -3, math.nan, math.inf])
def test_round_seconds_must_be_a_positive_number(value: float) -> None:
    assert "round_seconds must be a number of seconds > 0" in _error({"round_seconds": value})


def test_round_seconds_and_inner_steps_are_not_given_together() -> None:
    message = _error({"round_seconds": 30, "inner_steps": 50})
    assert "--round-seconds" in message and "--inner-steps" in message and "not both" in message


def test_round_seconds_is_part_of_the_fingerprint() -> None:
    plain, budget = build_config({}), build_config({"round_seconds": 30})
    assert "round_seconds" not in plain.fingerprint_fields()
    assert budget.fingerprint_fields()["round_seconds"] == 30.0
    assert budget.fingerprint() != plain.fingerprint() != build_config({"round_seconds": 31}).fingerprint()


def test_trainer_uses_the_budget_schedule_once_given_the_run_progress() -> None:
    import torch

    from diloco_node.train.inner import InnerTrainer

    trainer = InnerTrainer(torch.nn.Linear(2, 2), InnerConfig(lr=1e-3, warmup_steps=10, total_steps=20))
    trainer.step = 15
    assert trainer.lr() == lr_at(15, trainer.cfg)  # H steps per round: indexed by steps, as always
    trainer.progress = 0.5
    assert trainer.lr() == budget_lr_at(15, 0.5, trainer.cfg) == pytest.approx(5.5e-4)


# --- a skipped round -------------------------------------------------------------------------------


def test_a_round_without_steps_offers_nothing_and_takes_the_others_mean() -> None:
    """tokens 0 (daemon/node.py: no step fitted): no payload, so no peer counts a zero Δ, and the mean is the
    others' alone, exactly as theirs (what keeps φ equal in a blocking group)."""
    import torch

    from diloco_node.codec import CodecConfig, make_codec
    from diloco_node.outer.averaging import Averaging
    from diloco_node.round import Gathered, Outcome

    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 4, "skipper")
    own = averaging.encode(3, torch.zeros(4), 0.0)
    assert own.payload is None and own.decoded is None and own.tokens == 0.0
    others = {"b": (codec.encode(torch.tensor([1.0, 2.0, 3.0, 4.0])), 512.0),
              "c": (codec.encode(torch.tensor([4.0, 3.0, 2.0, 1.0])), 1536.0)}
    result = averaging.mean(own, Gathered(Outcome.TOGETHER, 3, others))
    assert result.group == ("b", "c")
    # the token cap of a pair is the smaller declaration, so b and c (equal norms) weigh alike (docs §3)
    assert torch.equal(result.mean, torch.tensor([2.5, 2.5, 2.5, 2.5]))


def test_a_skipped_round_records_no_loss_no_steps_and_says_skipped() -> None:
    from diloco_node.round import Own, RoundReport
    from diloco_node.telemetry.rounds import RoundTiming, Traffic, round_record

    report = RoundReport(Outcome.TOGETHER, Own(None, None, 0.0, 0.0), None)
    before = {"parameters": 10, "bytes_sent": 0, "bytes_received": 0}
    record = round_record(5, [], 3.2, report, RoundTiming(0.0, 2.5), Traffic(0, 0, {}), before, False, "d")
    assert record.skipped and record.loss is None
    assert (record.last_round_inner_steps, record.last_round_tokens, record.last_round_tokens_per_second) == (0, 0, 0)
    assert record.log_line().endswith("inner_steps=0 tokens=0 skipped")
    assert record.status({"compute_seconds": 0, "wait_seconds": 2.5, "utilization": 0.0})["last_round_skipped"]


# --- with fragments (docs/architecture.md §13, §15): a round moves one fragment and lasts T/P ----------


def test_with_fragments_a_round_lasts_t_over_p_and_any_number_of_fragments_is_accepted() -> None:
    cfg = build_config({"round_seconds": 30, "fragments": 3})
    assert cfg.round_budget == 10.0 and cfg.fingerprint_fields()["round_seconds"] == 30.0
    assert cfg.fingerprint_fields()["fragments"] == 3  # every member ends rounds on the same T/P grid
    assert build_config({"round_seconds": 30}).round_budget == 30.0
    assert build_config({"inner_steps": 4}).round_budget is None
    # H is not used under a time budget: P is bounded by the model's tensors only (checked at start-up)
    assert build_config({"round_seconds": 30, "fragments": 60}).round_budget == 0.5


@pytest.mark.parametrize("exchange", [0.3, 1.8])  # within 3T/(4P), and longer (a round of 2T/P then)
def test_fragments_move_one_at_a_time_each_every_t_on_the_grid(exchange: float) -> None:
    """The inner phases of consecutive rounds end on the grid of T/P (daemon/node.py asks `deadline` with
    `round_budget`), so P consecutive rounds, one exchange of each fragment, take T when the
    exchange fits, and a fragment's exchanges are P rounds apart: one fragment moves at a time."""
    cfg = build_config({"round_seconds": 6, "fragments": 3})
    seconds = cfg.round_budget
    assert seconds == 2.0
    now, ends, moved = 1_795_000_000.3, [], []  # moved: (round, fragment) in the order they exchanged
    for round_ in range(3 * cfg.outer.fragments):
        end = deadline(now, seconds)
        ends.append(end)
        moved.append((round_, round_ % cfg.outer.fragments))  # Fragments.of_round (outer/fragments.py)
        now = end + exchange  # the exchange of this round's fragment, then the next inner phase
    gap = (1 if exchange <= (1 - MIN_SHARE) * seconds else 2) * seconds
    assert {round(b - a, 6) for a, b in zip(ends, ends[1:], strict=False)} == {gap}
    assert all(math.isclose(end / seconds, round(end / seconds), abs_tol=1e-9) for end in ends)  # on the grid
    for fragment in range(cfg.outer.fragments):  # each fragment moves every P rounds: every T when exchanges fit
        own = [ends[r] for r, f in moved if f == fragment]
        assert {round(b - a, 6) for a, b in zip(own, own[1:], strict=False)} == {cfg.outer.fragments * gap}
    # each window of P consecutive rounds exchanges every fragment once
    assert all(sorted(f for _, f in moved[r:r + cfg.outer.fragments]) == list(range(cfg.outer.fragments))
               for r in range(len(moved) - cfg.outer.fragments + 1))


# --- weights in the mean -------------------------------------------------------------------------


@pytest.mark.parametrize(("weighting", "expected"), [
    # declared 4096, 2048, 1024: the cap (the median, 2048) counts them 2048, 2048, 1024
    ("tokens", (0.4, 0.4, 0.2)),
    ("sqrt-tokens", (math.sqrt(2) / (2 * math.sqrt(2) + 1),) * 2 + (1 / (2 * math.sqrt(2) + 1),)),
    ("equal", (1 / 3, 1 / 3, 1 / 3)),
])
def test_weighting_turns_counted_tokens_into_shares(weighting: str, expected: tuple[float, ...]) -> None:
    import torch

    from diloco_node.outer.aggregate import Contribution, aggregate

    vectors = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    contributions = [Contribution(peer, tokens, vector)
                     for peer, tokens, vector in zip("abc", (4096.0, 2048.0, 1024.0), vectors, strict=True)]
    result = aggregate(contributions, "mean", weighting=weighting)
    assert result.tokens == (2048.0, 2048.0, 1024.0)  # the cap comes first, whatever the weighting
    assert result.weights == pytest.approx(expected)
    assert sum(result.weights) == pytest.approx(1.0)
    assert torch.allclose(result.mean, sum(w * v for w, v in zip(expected, vectors, strict=True)))


def test_weighting_is_checked_and_fingerprinted_and_each_node_records_its_weight() -> None:
    import torch

    from diloco_node.codec import CodecConfig, make_codec
    from diloco_node.outer.aggregate import Contribution, aggregate
    from diloco_node.outer.averaging import Averaging
    from diloco_node.round import Gathered, RoundReport
    from diloco_node.telemetry.rounds import RoundTiming, Traffic, round_record

    with pytest.raises(ValueError, match="weighting"):
        aggregate([Contribution("a", 1.0, torch.ones(2))], weighting="loudest")
    assert "weighting" in _error({"weighting": "loudest"})
    # equal is the default (#41); tokens, the default before, keeps the fingerprint it had
    assert build_config({}).fingerprint_fields()["weighting"] == "equal"
    assert "weighting" not in build_config({"weighting": "tokens"}).fingerprint_fields()
    assert build_config({"weighting": "tokens"}).fingerprint() != build_config({}).fingerprint()

    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 2, "a", weighting="equal")
    own = averaging.encode(1, torch.tensor([3.0, 0.0]), 4096.0)
    other = codec.encode(torch.tensor([0.0, 3.0]))
    others = {"b": (other, 1024.0), "c": (other, 512.0)}
    result = averaging.mean(own, Gathered(Outcome.TOGETHER, 1, others))
    assert result.own_share == pytest.approx(1 / 3)  # 8× c's tokens, the same weight
    # a butterfly member takes its share from the owner's report of counted tokens, by the same weighting
    from diloco_node.outer.averaging import _share
    report = {"used": ["a", "b", "c"], "tokens": [2048.0, 2048.0, 1024.0]}
    assert _share(report, "c", "tokens") == pytest.approx(0.2)
    assert _share(report, "c", "sqrt-tokens") == pytest.approx(1 / (2 * math.sqrt(2) + 1))
    assert _share(report, "c", "equal") == pytest.approx(1 / 3)
    assert _share({"used": ["a"], "tokens": ["x"]}, "a") == _share(report, "z") == 0.0  # malformed, or not in it
    before = {"parameters": 2, "bytes_sent": 0, "bytes_received": 0}
    record = round_record(1, [2.0], 2.1, RoundReport(Outcome.TOGETHER, own, result), RoundTiming(1.0, 0.5),
                          Traffic(0, 0, {}), before, False, "d")
    assert record.last_round_weight == pytest.approx(0.3333)
    assert record.status({"compute_seconds": 1.0, "wait_seconds": 0.5, "utilization": 2 / 3})[
        "last_round_weight"] == pytest.approx(0.3333)


# --- declared tokens against a node's own throughput (docs/architecture.md §13) -------------------


def test_each_member_sees_the_tokens_each_payload_declared() -> None:
    import torch

    from diloco_node.codec import CodecConfig, make_codec
    from diloco_node.outer.averaging import Averaging
    from diloco_node.round import Gathered

    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 2, "a")
    own = averaging.encode(1, torch.tensor([1.0, 0.0]), 100.0)
    others = {"c": (codec.encode(torch.tensor([0.0, 1.0])), 1e30), "b": (codec.encode(torch.ones(2)), 50.0)}
    result = averaging.mean(own, Gathered(Outcome.TOGETHER, 1, others))
    assert result.declared == (("b", 50.0), ("c", 1e30))  # as declared, before the cap; ours is not judged


# --- warmup at the fastest member's pace ---------------------------------------------------------

TOKENS_PER_STEP = 16 * 128


@pytest.mark.parametrize(("step", "own", "others", "expected"), [
    (4, 4, [4 * TOKENS_PER_STEP], 4),  # alike: our own steps, as before
    (4, 4, [30 * TOKENS_PER_STEP, 8 * TOKENS_PER_STEP], 30),  # a 1x node beside a 7.5x one keeps its pace
    (4, 4, [30 * TOKENS_PER_STEP + TOKENS_PER_STEP - 1], 30),  # whole steps only
    (44, 4, [30 * TOKENS_PER_STEP], 50),  # never past the warmup
    (50, 4, [30 * TOKENS_PER_STEP], 50),  # past it: left alone (the decay follows the rounds)
    (120, 4, [300 * TOKENS_PER_STEP], 120),
    (4, 4, [], 4),  # alone, or a butterfly member: no declarations
    (4, 4, [1 * TOKENS_PER_STEP], 4),  # slower members never hold us back
    (4, 4, [math.inf, math.nan, -1e9, 0.0], 4),  # a declaration that is no number of tokens counts for nothing
    (4, 4, [64 * 4 * TOKENS_PER_STEP], 32),  # one member claiming 64x: at most 8x the typical (of two: ours)
    (4, 4, [64 * 4 * TOKENS_PER_STEP, 4 * TOKENS_PER_STEP, 4 * TOKENS_PER_STEP], 32),  # 8x the median
])
def test_warmup_goes_on_at_the_fastest_members_pace(step: int, own: int, others: list[float], expected: int) -> None:
    assert warmup_pace(step, own, others, TOKENS_PER_STEP, warmup_steps=50) == expected


def test_slow_and_fast_nodes_leave_the_warmup_in_the_same_round() -> None:
    """Steps 4 and 30 a round, warmup 50: by their own steps the slow node would warm up over 13 rounds
    and the fast one over 2; at the fastest member's pace both are warm from round 2 on."""
    slow = fast = 0
    for round_ in range(3):
        slow = warmup_pace(slow + 4, 4, [30 * TOKENS_PER_STEP], TOKENS_PER_STEP, 50)
        fast = warmup_pace(fast + 30, 30, [4 * TOKENS_PER_STEP], TOKENS_PER_STEP, 50)
        assert (slow >= 50) == (fast >= 50) == (round_ >= 1)
