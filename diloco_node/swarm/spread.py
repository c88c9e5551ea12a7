"""A fragment's payload served across its round, not in one burst (docs/architecture.md §15, issue #30).

With `--fragments P` under an overlapping sync (eager, delayed), round r's exchange runs beside round
r + 1's inner phase, so nothing waits for it: the serving of our payload may take most of that inner
phase at no cost in compute. Served at the link's rate, each fragment still bursts at the link's rate
(a 1-second window of egress holds the link's rate whatever P is); served at

    pace = payload bytes × receivers / window,   window = SPREAD_SHARE × the expected round

the round's egress is about payload × receivers / window, 1/P of what P = 1 needs over the same
training. The pace is one token bucket of the node's payload serving, its rate set by each round's
offer and shared by every peer fetching the last two rounds (a slow fetch of the previous round
shares it with the new one: two paces at once would double the peak), and it sits on top of the
node's upload bucket (throttle.py): never faster than `--upload-limit`.

The expected round: T/P under `--round-seconds` (the round's budget), else the mean of our last
`RECENT_ROUNDS` inner phases (the time the next round's exchange has beside it). The window is kept
to `TIMEOUT_SHARE` of the round timeout, which is how long a peer fetching it waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_node.rates import MIN_RATE
from diloco_node.swarm.streams import HEADER_LEN
from diloco_node.swarm.throttle import TokenBucket

# An unpaced payload goes out in chunks of this size, each read by the fetcher within stall_seconds
DRAIN_CHUNK = 64 * 1024
STALL_SECONDS = 10.0
# Of the expected round, what the serving may fill: matchmaking takes the round's first second or
# two, and the next round must not wait for a serving that ran past its inner phase.
SPREAD_SHARE = 0.75
RECENT_ROUNDS = 4  # inner phases a fixed-H round's expected length is the mean of
TIMEOUT_SHARE = 0.5  # a fetcher waits the round timeout for the whole payload: half of it, at most


@dataclass(frozen=True)
class Spread:
    """How one round's offer is served: over `window` seconds to `receivers` peers, at `expected`
    seconds a round (for the planning line)."""

    window: float
    receivers: int
    expected: float

    def rate(self, payload_bytes: int) -> float:
        """Bytes/s that serve `payload_bytes` to every receiver within the window."""
        return payload_bytes * max(self.receivers, 1) / self.window


def spread_window(round_budget: float | None, recent: Sequence[float],
                  round_timeout: float) -> tuple[float, float] | None:
    """(window, expected round) in seconds; None when nothing tells how long a round is (no round
    timed yet under a fixed H)."""
    expected = round_budget or (sum(recent[-RECENT_ROUNDS:]) / len(recent[-RECENT_ROUNDS:]) if recent else 0.0)
    if expected <= 0:
        return None
    return min(SPREAD_SHARE * expected, TIMEOUT_SHARE * round_timeout), expected


class RoundClock:
    """The node's recent inner-phase durations, and the spread they give the next offer."""

    def __init__(self, round_budget: float | None, round_timeout: float):
        self.round_budget, self.round_timeout = round_budget, round_timeout
        self._recent: deque[float] = deque(maxlen=RECENT_ROUNDS)

    def ran(self, seconds: float) -> None:
        """An inner phase took `seconds` (a skipped round's too: that is how long the round had)."""
        self._recent.append(seconds)

    def spread(self, receivers: int) -> Spread | None:
        window = spread_window(self.round_budget, list(self._recent), self.round_timeout)
        return Spread(window[0], receivers, window[1]) if window else None


def pace_for(spread: Spread | None, payload_bytes: int, upload_rate: float) -> float:
    """The pace (bytes/s) a round's offer is served at; 0 (none) where the node's upload bucket
    alone (`upload_rate` bytes/s, 0: none) is already as slow: no spread asked, or a cap below it."""
    if spread is None or payload_bytes <= 0:
        return 0.0
    rate = spread.rate(payload_bytes)
    return rate if not upload_rate or rate < upload_rate else 0.0


async def send_paced(writer: asyncio.StreamWriter, data: bytes, pace: TokenBucket | None) -> None:
    """streams.send, each chunk after its tokens from `pace` (then the writer's own bucket), and each
    chunk read by the other end within stall_seconds(chunk): a fetcher that asks and then reads
    nothing holds its stream for that long, not for as long as the write blocks (docs/trust.md)."""
    writer.write(len(data).to_bytes(HEADER_LEN, "big"))
    view = memoryview(data)
    # read once: the next round's offer may change the bucket's chunk while this payload is sent
    step = pace.chunk if pace is not None else DRAIN_CHUNK
    for start in range(0, len(view), step):
        chunk = view[start:start + step]
        if pace is not None:
            await pace.take(len(chunk))
        writer.write(bytes(chunk))
        await asyncio.wait_for(writer.drain(), stall_seconds(len(chunk)))
    if not data:
        await asyncio.wait_for(writer.drain(), stall_seconds(HEADER_LEN))


def stall_seconds(size: int) -> float:
    """How long a reader may take to read `size` bytes we wrote: STALL_SECONDS, and the time the
    slowest rate a node may run at (rates.MIN_RATE) needs for them."""
    return STALL_SECONDS + size / MIN_RATE
