"""Whether a round's exchange fits the node's caps, said once (docs/architecture.md §14).

At a cap the exchange of a round takes payload × fan-out / cap seconds, however fast the link is.
When that is longer than the round trains, an overlapped node's exchange no longer hides behind
the next inner phase (it falls behind until the sync timeout applies rounds alone) and a blocking
node idles longer than it trains; beyond the round timeout the fetches time out. The node cannot
fix that itself, the volunteer can: a smaller codec, `--fragments`, or longer rounds. So the first
round that shows it is logged once with its numbers, and never again (the figures change little
from round to round, and a line per round would bury the log).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from diloco_node.rates import format_rate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExchangePlan:
    """What one round's exchange needs at the caps."""

    payload: int  # bytes of our encoded contribution
    fan_out: float  # payloads that go out (and come in) per round: M − 1 all-gather, 2(M − 1)/M butterfly
    seconds: float  # the longer of upload and download at their caps
    cap: float  # bytes/s of the direction that takes longer


def fan_out(group_size: int, butterfly_from: int | None) -> float:
    """Payloads one node sends (and receives) in a round of `group_size` (docs/architecture.md §2,
    transport traffic): every other member's fetch in an all-gather, about 2(M − 1)/M in a butterfly."""
    others = max(group_size - 1, 0)
    if butterfly_from is not None and group_size >= butterfly_from:
        return 2 * others / group_size
    return float(others)


def plan(payload: int, group_size: int, butterfly_from: int | None, upload: float,
         download: float) -> ExchangePlan | None:
    """The exchange's time at the caps (bytes/s, 0: none); None when nothing is capped or nothing moves."""
    moved = payload * fan_out(group_size, butterfly_from)
    times = [(moved / cap, cap) for cap in (upload, download) if cap > 0]
    if not times or moved <= 0:
        return None
    seconds, cap = max(times)
    return ExchangePlan(payload, fan_out(group_size, butterfly_from), seconds, cap)


class Planner:
    """Checks each finished round against the caps and says once when the exchange cannot keep up."""

    def __init__(self, upload: float, download: float, butterfly_from: int | None, round_timeout: float,
                 state_bytes: int = 0, state_rate: float = 0.0, catch_up_rounds: int = 0):
        """`state_bytes` served to a joiner at `state_rate` (bytes/s a transfer gets at our upload cap;
        0: none), which a joiner catches up on when it is at most `catch_up_rounds` rounds late."""
        self.upload, self.download = upload, download
        self.butterfly_from, self.round_timeout = butterfly_from, round_timeout
        self.state_bytes, self.state_rate, self.catch_up_rounds = state_bytes, state_rate, catch_up_rounds
        self.told = self.state_told = False

    def check_state(self, round_seconds: float) -> str | None:
        """The serving side's line, once: a joiner's download of our state at our cap outlasts a round
        (docs/architecture.md §14), so it arrives superseded and the joiner catches it up on the means
        since, or, beyond `catch_up_rounds`, cannot join from us. None when it fits or nothing is capped."""
        if self.state_told or self.state_rate <= 0 or round_seconds <= 0:
            return None
        seconds = self.state_bytes / self.state_rate
        if seconds <= round_seconds:
            return None
        self.state_told = True
        rounds = seconds / round_seconds
        then = (f"a joiner catches up on those rounds' means (up to {self.catch_up_rounds})"
                if rounds <= self.catch_up_rounds else
                f"more than the {self.catch_up_rounds} a joiner catches up on: joiners cannot take our state")
        line = (f"serving our state to a joiner takes up to {seconds:.0f}s at the cap ({self.state_bytes / 1e6:.1f} MB "
                f"at {format_rate(self.state_rate)}, our share of it for each of the transfers served at once), "
                f"{rounds:.1f} rounds of {round_seconds:.0f}s: {then}. "
                f"A higher --upload-limit or longer rounds avoid it")
        logger.warning(line)
        return line

    def check(self, payload: int, group_size: int, round_seconds: float) -> str | None:
        """The line logged when this round's exchange at the caps takes longer than `round_seconds`
        (the round's training); None when it fits, nothing is capped, or it was said already."""
        if self.told or group_size < 2:  # alone or held: nothing moved to judge by
            return None
        needed = plan(payload, group_size, self.butterfly_from, self.upload, self.download)
        if needed is None or needed.seconds <= round_seconds:
            return None
        self.told = True
        timeout = (f"; beyond the round timeout of {self.round_timeout:.0f}s, so fetches will time out"
                   if needed.seconds > self.round_timeout else "")
        line = (f"the exchange cannot finish within a round at the cap: payload {needed.payload / 1e6:.2f} MB "
                f"x fan-out {needed.fan_out:.2g} at {format_rate(needed.cap)} takes {needed.seconds:.0f}s, "
                f"a round trains {round_seconds:.0f}s{timeout}. To fit: a smaller codec (--compression int4, "
                f"topk or sign), --fragments, or longer rounds (more --inner-steps)")
        logger.warning(line)
        return line
