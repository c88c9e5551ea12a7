"""A fragment's payload served across its round (swarm/spread.py, docs/architecture.md §15): the
window and pace chosen, the paced send (on a virtual clock), and that the exchange serves each
round's offer through that round's pace and an older round's at the cap. Seams only: the streams
and the peer's stream are stand-ins."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from diloco_node.rates import MIN_RATE
from diloco_node.swarm import exchange as exchange_module
from diloco_node.swarm import spread as spread_module
from diloco_node.swarm import throttle
from diloco_node.swarm.exchange import RECEIVED, PayloadExchange
from diloco_node.swarm.spread import (
    RECENT_ROUNDS,
    SPREAD_SHARE,
    TIMEOUT_SHARE,
    RoundClock,
    Spread,
    pace_for,
    send_paced,
    spread_window,
)
from diloco_node.swarm.streams import HEADER_LEN
from diloco_node.swarm.throttle import Throttle, TokenBucket

MB = 1_000_000


def test_the_window_is_three_quarters_of_the_round_budget_under_round_seconds() -> None:
    window, expected = spread_window(10.0, [3.0, 4.0], round_timeout=60.0) or (0, 0)
    assert expected == 10.0 and window == pytest.approx(SPREAD_SHARE * 10.0)  # T/P, not the measured phases


def test_the_window_follows_the_mean_of_recent_inner_phases_under_a_fixed_h() -> None:
    recent = [100.0] + [8.0] * (RECENT_ROUNDS - 1) + [12.0]  # the oldest is forgotten
    window, expected = spread_window(None, recent, round_timeout=60.0) or (0, 0)
    assert expected == pytest.approx((8.0 * (RECENT_ROUNDS - 1) + 12.0) / RECENT_ROUNDS)
    assert window == pytest.approx(SPREAD_SHARE * expected)


def test_the_window_leaves_a_fetcher_its_timeout() -> None:
    window, _ = spread_window(None, [300.0], round_timeout=60.0) or (0, 0)
    assert window == pytest.approx(TIMEOUT_SHARE * 60.0)


def test_no_window_before_any_round_is_timed() -> None:
    assert spread_window(None, [], round_timeout=60.0) is None
    assert RoundClock(None, 60.0).spread(2) is None


def test_the_round_clock_spreads_over_its_recent_rounds() -> None:
    clock = RoundClock(None, 180.0)
    for seconds in (10.0, 14.0):
        clock.ran(seconds)
    assert clock.spread(2) == Spread(SPREAD_SHARE * 12.0, 2, 12.0)


def test_the_pace_serves_every_receiver_within_the_window() -> None:
    spread = Spread(window=10.0, receivers=2, expected=13.3)
    assert spread.rate(MB) == pytest.approx(2 * MB / 10.0)
    assert pace_for(spread, MB, upload_rate=0.0) == pytest.approx(2 * MB / 10.0)
    assert pace_for(spread, MB, upload_rate=10 * MB) == pytest.approx(2 * MB / 10.0)  # a cap above: the pace binds


def test_no_pace_without_a_spread_or_under_a_slower_cap() -> None:
    spread = Spread(window=10.0, receivers=2, expected=13.3)
    assert pace_for(None, MB, upload_rate=0.0) == 0.0
    assert pace_for(spread, MB, upload_rate=100_000.0) == 0.0  # the node's upload bucket is slower already
    assert pace_for(spread, 0, upload_rate=0.0) == 0.0


class VirtualTime:
    """A clock that only moves when a paced stream sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Writer:
    """A stream's writing end that records (virtual time, bytes so far) at each write."""

    def __init__(self, clock: VirtualTime) -> None:
        self.clock, self.data, self.writes = clock, bytearray(), []  # type: ignore[var-annotated]

    def write(self, data: bytes) -> None:
        self.data += data
        self.writes.append((self.clock.now, len(self.data), len(data)))

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    clock = VirtualTime()
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        clock.now += seconds
        await real_sleep(0)
    monkeypatch.setattr(throttle.asyncio, "sleep", sleep)
    return clock


def test_a_paced_send_never_runs_ahead_of_its_pace(virtual: VirtualTime) -> None:
    rate, size = 100_000.0, 250_000
    bucket = TokenBucket(rate, clock=virtual)
    writer = Writer(virtual)
    asyncio.run(send_paced(writer, b"x" * size, bucket))  # type: ignore[arg-type]
    assert bytes(writer.data) == size.to_bytes(HEADER_LEN, "big") + b"x" * size
    for at, sent, chunk in writer.writes[1:]:  # after the header: every chunk after its tokens
        assert chunk <= bucket.chunk
        assert sent - HEADER_LEN <= bucket.capacity + rate * at + 1e-6
    assert virtual.now >= (size - bucket.capacity) / rate - 1e-6  # the whole took about size / rate


def test_a_new_pace_during_a_send_leaves_its_bytes_whole(virtual: VirtualTime) -> None:
    """The next round's offer sets the shared bucket's rate (and so its chunk) while this round's
    payload is still going out: each byte still goes once, in order (a chunk read anew per slice
    sent overlapping slices: 'payload checksum mismatch' at the fetchers)."""
    bucket = TokenBucket(20_000.0, clock=virtual)
    data = bytes(range(256)) * 400
    writer = Writer(virtual)

    async def both() -> None:
        sending = asyncio.ensure_future(send_paced(writer, data, bucket))  # type: ignore[arg-type]
        while len(writer.data) < len(data) // 3:
            await asyncio.sleep(0)
        bucket.set_rate(200_000.0)  # a 10x larger chunk from now on
        await sending
    asyncio.run(both())
    assert bytes(writer.data) == len(data).to_bytes(HEADER_LEN, "big") + data


def test_an_unpaced_send_is_the_plain_framing(virtual: VirtualTime) -> None:
    writer = Writer(virtual)
    asyncio.run(send_paced(writer, b"abc", None))  # type: ignore[arg-type]
    assert bytes(writer.data) == (3).to_bytes(HEADER_LEN, "big") + b"abc" and virtual.now == 0.0


class Streams:
    """What PayloadExchange reads of the node's streams: its caps, its loop, the byte count."""

    def __init__(self, upload: float = 0.0) -> None:
        self.throttle = Throttle(upload=upload)
        self.p2p, self.loop = None, None

    def count(self, sent: int = 0, received: int = 0) -> None:
        return None


def exchange(upload: float = 0.0) -> PayloadExchange:
    return PayloadExchange(Streams(upload), "ns", 1 << 24, lambda peer, round_, token, group: None)  # type: ignore[arg-type]


SPREAD = Spread(window=10.0, receivers=2, expected=13.3)


def test_the_last_two_offers_share_one_pace_and_older_ones_go_at_the_cap() -> None:
    payloads = exchange()
    for round_ in (1, 2, 3):
        payloads.offer(round_, b"p" * MB, 10.0, SPREAD)
    assert payloads._pace.rate == pytest.approx(SPREAD.rate(MB))
    assert [payloads._offers[r].paced for r in (1, 2, 3)] == [False, True, True]
    payloads.offer(4, b"p" * (MB // 2), 10.0, SPREAD)  # the next round's pace is the one bucket's
    assert payloads._pace.rate == pytest.approx(SPREAD.rate(MB // 2))


def test_offers_without_a_spread_or_under_a_slower_cap_are_not_paced() -> None:
    plain = exchange()
    plain.offer(1, b"p" * MB, 10.0, SPREAD)
    plain.offer(2, b"p" * MB, 10.0)  # no spread (blocking, P = 1): round 1's late fetch is not paced either
    assert plain._pace.rate == 0.0
    capped = exchange(upload=50_000.0)  # 0.4 Mbit/s: slower than 2 MB over 10 s
    capped.offer(1, b"p" * MB, 10.0, SPREAD)
    assert capped._pace.rate == 0.0


def test_the_planning_line_says_the_pace_once(caplog: pytest.LogCaptureFixture) -> None:
    payloads = exchange()
    with caplog.at_level("INFO", logger=exchange_module.__name__):
        payloads.offer(1, b"p" * MB, 10.0, SPREAD)
        payloads.offer(2, b"p" * MB, 10.0, SPREAD)
    said = [r.getMessage() for r in caplog.records if "serving each payload across the round" in r.getMessage()]
    assert len(said) == 1
    assert "1.00 MB x 2 receiver(s) over 10.0s" in said[0] and "1.6 Mbit/s" in said[0]


def serve(payloads: PayloadExchange, round_: int, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, Any]:
    """Serve one fetch of `round_`; what went out and the pace it was sent through."""
    used: list[Any] = []

    async def recorded(writer: Any, data: bytes, pace: TokenBucket | None) -> None:
        used.append(pace)
        await send_paced(writer, data, None)
    monkeypatch.setattr(exchange_module, "send_paced", recorded)

    async def one() -> bytes:
        payloads.loop = asyncio.get_running_loop()
        request = json.dumps({"round": round_, "admission": ""}).encode()
        reader = asyncio.StreamReader()
        reader.feed_data(len(request).to_bytes(HEADER_LEN, "big") + request + RECEIVED)
        reader.feed_eof()
        writer = Writer(VirtualTime())
        info = type("Info", (), {"peer_id": "peer-b"})()
        await payloads._serve(info, reader, writer)  # type: ignore[arg-type]
        return bytes(writer.data)
    return asyncio.run(one()), used[0]


def test_a_fetch_is_served_through_the_pace_unless_its_round_is_older(monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = exchange()
    for round_, payload in ((1, b"oldest"), (2, b"previous"), (3, b"latest")):
        payloads.offer(round_, payload, 10.0, SPREAD)
    for round_, payload, paced in ((3, b"latest", True), (2, b"previous", True), (1, b"oldest", False)):
        sent, pace = serve(payloads, round_, monkeypatch)
        assert sent.endswith(payload) and (pace is payloads._pace if paced else pace is None)
        assert payloads._offers[round_].served == {"peer-b"}


class StalledWriter(Writer):
    """A fetcher that asked and then reads nothing: its writes never drain."""

    async def drain(self) -> None:
        await asyncio.Event().wait()


@pytest.mark.parametrize("paced", [False, True], ids=["unpaced", "paced"])
def test_a_fetcher_that_reads_nothing_holds_the_stream_a_bounded_time(monkeypatch: pytest.MonkeyPatch,
                                                                       paced: bool) -> None:
    """The payload handler's write (exchange._serve) used to wait for a drain with no deadline."""
    monkeypatch.setattr(spread_module, "STALL_SECONDS", 0.05)
    monkeypatch.setattr(spread_module, "MIN_RATE", 1e12)  # the stall bound alone, so the test is quick
    writer = StalledWriter(VirtualTime())
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        asyncio.run(send_paced(writer, b"x" * 300_000, TokenBucket(1e9) if paced else None))  # type: ignore[arg-type]
    assert time.monotonic() - started < 5.0
    assert 0 < len(writer.data) < 300_000  # it stopped at the first chunk nobody read


def test_a_slow_reader_is_given_the_slowest_rate_a_node_may_run_at() -> None:
    assert spread_module.stall_seconds(0) == spread_module.STALL_SECONDS
    assert spread_module.stall_seconds(64_000) == pytest.approx(spread_module.STALL_SECONDS + 64_000 / MIN_RATE)
