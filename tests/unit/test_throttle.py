"""The node's caps (diloco_node/swarm/throttle.py) on a fake clock: no real time passes."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from diloco_node.swarm import throttle
from diloco_node.swarm.throttle import BURST_SECONDS, STREAM_SHARE, PacedReader, PacedWriter, Throttle, TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """A clock that asyncio.sleep inside throttle.py advances instead of waiting."""
    fake = FakeClock()
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        fake.now += seconds
        await real_sleep(0)  # let the other streams run, as a real wait would

    monkeypatch.setattr(throttle.asyncio, "sleep", sleep)
    return fake


class Sink:
    """A stream's writing end that notes when each byte left (on the fake clock)."""

    def __init__(self, clock: FakeClock, log: list[tuple[float, int]]):
        self.clock, self.log, self.closed = clock, log, False

    def write(self, data) -> None:
        self.log.append((self.clock.now, len(data)))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def windows(log: list[tuple[float, int]], start: float) -> dict[int, int]:
    """Bytes per 1-second window from `start`."""
    counts: dict[int, int] = defaultdict(int)
    for at, size in log:
        counts[int(at - start)] += size
    return counts


def test_an_uncapped_bucket_never_waits():
    bucket = TokenBucket(0)
    assert [bucket.wait(10 ** 9) for _ in range(3)] == [0, 0, 0]


def test_a_bucket_lends_its_burst_then_waits_for_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(1000, clock)
    burst = int(1000 * BURST_SECONDS)
    assert bucket.wait(burst) == 0  # the saved burst, taken
    assert bucket.wait(burst) == pytest.approx(BURST_SECONDS)  # nothing taken: wait for the rate
    clock.now += BURST_SECONDS
    assert bucket.wait(burst) == 0
    clock.now += 10  # idle: refills up to the burst only
    assert bucket.wait(burst) == 0
    assert bucket.wait(1) > 0


def test_a_chunk_larger_than_the_burst_goes_once_a_burst_is_saved_and_is_paid_back():
    clock = FakeClock()
    bucket = TokenBucket(1000, clock)  # a burst of 50 B
    assert bucket.wait(500) == 0
    assert bucket.wait(500) == pytest.approx((500 - 50 + 50) / 1000)  # the debt, then a burst
    bucket.owe(1000)
    assert bucket.wait(1) == pytest.approx(1.45 + 0.001)


def test_streams_that_wake_late_do_not_catch_up():
    """Three streams asking for chunks every 10 ms, and a second in which none of them runs (the
    loop stalled behind a busy CPU): when they run again they find only a burst saved, so no
    1-second window carries more than the cap, a burst and a chunk."""
    clock = FakeClock()
    cap = 100_000
    bucket = TokenBucket(cap, clock)
    start, log = clock.now, []
    for tick in range(400):
        clock.now = start + tick / 100
        if 1.0 <= clock.now - start < 2.0:
            continue  # the stall
        for _ in range(3):
            if bucket.wait(bucket.chunk) == 0:
                log.append((clock.now, bucket.chunk))
    per_window = [sum(size for at, size in log if t <= at < t + 1) for t in (start + k / 100 for k in range(300))]
    assert max(per_window) <= cap + bucket.capacity + bucket.chunk
    assert sum(size for at, size in log if at >= start + 3) >= 0.9 * cap  # and the cap is used


def test_writes_of_two_streams_together_keep_the_cap_in_every_second(clock):
    """Two joiners served at once, each a 3 s state at the full cap: the sum of their bytes in any
    1-second window stays within 1.1 x the cap, and both get their whole state."""
    cap = 250_000  # 2 Mbit/s
    paced = Throttle(upload=cap, clock=clock)
    log: list[tuple[float, int]] = []
    start = clock.now

    async def serve() -> None:
        writer = paced.writer(Sink(clock, log))  # type: ignore[arg-type]
        writer.write(b"h" * 8)
        for _ in range(12):
            writer.write(bytes(cap // 4))
            await writer.drain()

    async def both() -> None:
        await asyncio.gather(serve(), serve())

    asyncio.run(both())
    assert sum(size for _, size in log) == 2 * (8 + 12 * (cap // 4))
    assert max(size for _, size in log) <= paced.upload.chunk
    per_second = windows(log, start)
    assert len(per_second) >= 5  # 6 MB... at the cap takes its time
    assert max(per_second.values()) <= 1.1 * cap
    assert max(per_second.values()) >= 0.9 * cap * STREAM_SHARE  # and the cap is used


class Source:
    """A stream's reading end holding `size` bytes; notes when each byte was read (fake clock)."""

    def __init__(self, size: int, clock: FakeClock):
        self.left, self.clock, self.log = size, clock, []

    async def read(self, n: int) -> bytes:
        taken = min(n, self.left)
        self.left -= taken
        self.log.append((self.clock.now, taken))
        return bytes(taken)

    async def readexactly(self, n: int) -> bytes:
        if n > self.left:
            raise asyncio.IncompleteReadError(bytes(self.left), n)
        return await self.read(n)


def test_reads_are_paced_like_writes(clock):
    cap = 100_000
    bucket = Throttle(download=cap, clock=clock).download
    source = Source(450_000, clock)
    reader = PacedReader(source, bucket)  # type: ignore[arg-type]
    start = clock.now

    async def read_all() -> int:
        got = len(await reader.readexactly(200_000))
        while chunk := await reader.read(1 << 20):
            got += len(chunk)
        return got

    assert asyncio.run(read_all()) == 450_000
    log = source.log
    assert clock.now - start >= (450_000 - bucket.capacity) / bucket.rate - 1e-6
    assert max(windows(log, start).values()) <= 1.1 * cap


def test_a_writer_queues_until_drained_and_close_sends_the_rest(clock):
    log: list[tuple[float, int]] = []
    sink = Sink(clock, log)
    writer = PacedWriter(sink, TokenBucket(10_000, clock))  # type: ignore[arg-type]
    writer.write(b"abc")
    assert log == []
    writer.close()
    assert log == [(clock.now, 3)] and sink.closed


def test_a_bucket_takes_a_new_rate_keeping_no_more_than_its_new_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(1000.0, clock=lambda: now[0])
    assert bucket.wait(50) == 0.0  # the full burst of 50 ms
    bucket.set_rate(100.0)
    assert bucket.capacity == pytest.approx(100.0 * BURST_SECONDS)
    now[0] += 0.05
    assert bucket.wait(5) == 0.0 and bucket.wait(5) > 0  # 5 B accrued at the new rate, no more
    bucket.set_rate(0.0)
    assert bucket.wait(1 << 20) == 0.0  # no rate: no pace
