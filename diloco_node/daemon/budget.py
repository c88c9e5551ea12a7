"""Rounds by time budget (`--round-seconds T`, docs/architecture.md §13): when a round's inner phase
ends, when a node should not start another step, and under `--speed-spent batch` how many batches
each of its H steps accumulates.

The deadlines are the points k·T of the swarm's clock (hivemind's DHT time, the Unix time every
node's records already expire by), so every node computes the same ones without a message: no
round-0 start to publish, nothing a frozen or joining node could miss. A round's inner phase runs to
the first grid point at least MIN_SHARE·T ahead; nodes that finished the last exchange together
therefore stop together, whatever their speed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from diloco_node.outer.aggregate import token_cap
from diloco_node.trust.work import PEER_SPEEDUP

# An inner phase that would start with less than this share of T left runs to the grid point after:
# a blocking exchange ending just before a grid point would otherwise leave a round of a few steps
# (or none) for everyone. Small, because a blocking exchange longer than (1 − MIN_SHARE)·T makes the
# round 2T. Nodes that straddle it by a moment pick deadlines T apart; the earlier one
# then waits at the barrier, and the next round's deadline is common again.
MIN_SHARE = 0.25
# The next step is estimated by the longest of the last STEP_WINDOW steps: stopping a step early
# costs a step, overshooting holds the whole group at the barrier.
STEP_WINDOW = 4
# Under --round-seconds the barrier waits for peers up to this share of T (at least BARRIER_FLOOR s,
# at most --round-timeout): every node stops by the deadline (announcing ready before its eval), so
# a peer not ready a round after it is frozen or gone and must not hold the others (§13).
BARRIER_SHARE = 1.0
BARRIER_FLOOR = 2.0
# Under --speed-spent batch one step accumulates at most this many batches: a peer that declares more
# than PEER_SPEEDUP times our round's tokens is doubted (trust/work.py), so an honest node 64× faster
# than the slowest stops there; and a step timed absurdly short (a clock's hiccup) cannot make the
# next step a whole round long.
MAX_ACCUMULATION = int(PEER_SPEEDUP)
# During the warmup one member's declared round moves our schedule on by at most this many of the
# group's typical rounds: a pair 7.5x apart (tests/unit/test_budget.py) and 4:2:1:1 still leave the
# warmup together, and one member claiming 64x cannot end everyone's warmup in a round.
WARMUP_PACE_MULTIPLE = 8.0


def deadline(now: float, seconds: float) -> float:
    """The end of the inner phase that starts at `now` on the swarm's clock: the first point k·T
    (k an integer) at least MIN_SHARE·T after `now`."""
    end = (math.floor(now / seconds) + 1) * seconds
    return end + seconds if end - now < MIN_SHARE * seconds else end


def barrier_timeout(seconds: float, round_timeout: float) -> float:
    """How long the barrier waits for peers in a round of `seconds` (see BARRIER_SHARE)."""
    return min(round_timeout, max(BARRIER_FLOOR, BARRIER_SHARE * seconds))


def warmup_pace(step: int, own_steps: int, others_tokens: Iterable[float], tokens_per_step: int,
                warmup_steps: int) -> int:
    """Where our learning-rate schedule stands after a round under --round-seconds: during the warmup
    it moves on by the most steps one member of the group trained that round (its declared tokens in
    our steps), not only by our `own_steps`, so a slow node leaves its warmup in the same round as
    the fastest one instead of spending many rounds at a small lr, with a short Δ that becomes the
    median norm longer Δs are clipped to (docs/architecture.md §13, "Warmup"). Past the warmup the
    step is left alone: the decay follows the run's rounds. A declaration that is not a finite
    positive number counts for nothing, and one counts for at most WARMUP_PACE_MULTIPLE × the
    group's typical declaration (ours among them; the token cap's median, of two the smaller), so
    one member that claims a huge round cannot end everyone's warmup at once."""
    if step >= warmup_steps:
        return step
    declared = [t for t in others_tokens if math.isfinite(t) and t > 0]
    if not declared:
        return step
    fastest = min(max(declared), WARMUP_PACE_MULTIPLE * token_cap([*declared, own_steps * tokens_per_step], None))
    return max(step, min(warmup_steps, step - own_steps + int(fastest // tokens_per_step)))


def accumulation(left: float, steps: int, batch_seconds: float | None, most: int = MAX_ACCUMULATION) -> int:
    """k, the batches the next inner step accumulates under --speed-spent batch: the most that lets
    `steps` more steps of k batches each end within `left` seconds, one batch taking `batch_seconds`
    (None: not measured yet), between 1 and `most`:

        k = max(1, min(most, ⌊left / (steps · batch_seconds)⌋))

    Sized again before every step from the time and steps left, so a node whose speed changes within
    a round adapts at its next step, and the time a floor leaves is taken by the last steps. k = 1
    may still not fit: next_batches then ends the round early."""
    if batch_seconds is None or not batch_seconds > 0 or steps < 1:
        return 1  # nothing measured: one batch measures our speed
    return max(1, min(most, math.floor(left / (steps * batch_seconds))))


class StepClock:
    """Durations of this node's recent inner steps (under --speed-spent batch: per batch, a step's
    seconds over its batches), and whether one more fits before a deadline. Used by the round loop's
    thread only."""

    def __init__(self, window: int = STEP_WINDOW):
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)

    def forget(self) -> None:
        """After a skipped round: measure again. A step timed while the machine was busy (or the node
        stopped) would otherwise make every later round look too short to try."""
        self.recent.clear()

    def estimate(self) -> float | None:
        """The next step's expected seconds; None before any step was timed."""
        return max(self.recent) if self.recent else None

    def fits(self, now: float, end: float) -> bool:
        """Whether a step started at `now` is expected to end by `end`. With no step timed yet it is
        tried: a node's first step measures its speed."""
        estimate = self.estimate()
        return now < end if estimate is None else now + estimate <= end


def next_batches(now: float, end: float, done: int, steps: int, clock: StepClock) -> int:
    """Under --speed-spent batch: the batches the next of the round's `steps` inner steps accumulates,
    `done` of them taken (accumulation), with `clock` timing one batch; 0 when the round's inner phase
    is over: its H steps are done, or not even a step of one batch is expected to end by `end` (a node
    too slow for H steps of one batch trains fewer steps, as under --speed-spent steps; none: the
    round is skipped)."""
    if done >= steps or not clock.fits(now, end):
        return 0
    return accumulation(end - now, steps - done, clock.estimate())
