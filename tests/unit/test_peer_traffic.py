"""The live per-peer stream rates (swarm/peer_traffic.py): one-second samples, a five-sample window,
the busiest peers named and the rest summed as "other", counted beneath the caps' pacing; and
how /api/status and /metrics carry them (docs/architecture.md §14, "Shown")."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from diloco_node.swarm.peer_traffic import (
    MAX_PEERS_A_SAMPLE,
    OTHER,
    TOP_PEERS,
    WINDOW_SAMPLES,
    CountedReader,
    CountedWriter,
    PeerTraffic,
)
from diloco_node.swarm.throttle import Throttle
from diloco_node.telemetry.meter import Telemetry
from tests.unit.test_server import RUN, serve


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def rows(rates: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return {row["peer_id"]: (row["stream_egress_bytes_per_second"], row["stream_ingress_bytes_per_second"])
            for row in rates["peer_streams"]}


def test_rates_are_the_bytes_of_the_last_five_samples_per_peer_and_in_total() -> None:
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    clock.now = 1010.0  # long after start: the window is a full one
    traffic.count("A", sent=5000)
    traffic.count("B", received=2000)
    clock.now = 1012.5
    traffic.count("A", sent=5000, received=1000)
    clock.now = 1014.5  # the window: the samples of seconds 1010 … 1014, 4.5 s of them so far
    rates = traffic.rates()
    assert rows(rates) == {"A": (round(10_000 / 4.5, 1), round(1000 / 4.5, 1)), "B": (0.0, round(2000 / 4.5, 1))}
    assert list(rows(rates)) == ["A", "B"]  # busiest first
    assert rates["stream_egress_bytes_per_second"] == round(10_000 / 4.5, 1)
    assert rates["stream_ingress_bytes_per_second"] == round(3000 / 4.5, 1)


def test_a_sample_older_than_the_window_drops_out_and_an_idle_peer_leaves_the_list() -> None:
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    clock.now = 1010.2
    traffic.count("A", sent=4000)
    clock.now = 1013.2
    traffic.count("B", sent=1000)
    before = traffic.rates()
    clock.now = 1015.0  # second 1010 is out of the window (1011 … 1015)
    after = traffic.rates()
    assert "A" in rows(before) and "A" not in rows(after)
    assert rows(after) == {"B": (round(1000 / 4.0, 1), 0.0)}
    clock.now = 1030.0  # nothing moved for a while: no rows, zero totals (the rates change, and fall)
    idle = traffic.rates()
    assert idle == {"stream_egress_bytes_per_second": 0.0, "stream_ingress_bytes_per_second": 0.0, "peer_streams": []}


def test_early_on_the_rate_is_over_the_time_since_start_never_under_one_sample() -> None:
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    clock.now = 1000.1
    traffic.count("A", sent=1000)
    assert rows(traffic.rates()) == {"A": (1000.0, 0.0)}  # over one sample, not over 0.1 s
    clock.now = 1002.0
    assert rows(traffic.rates()) == {"A": (500.0, 0.0)}  # over the two seconds since start, not five


def test_beyond_the_busiest_peers_the_rest_is_one_other_row() -> None:
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    clock.now = 1010.0
    for index in range(TOP_PEERS + 4):
        traffic.count(f"peer{index:03d}", sent=1000 * (index + 1))
    clock.now = 1011.0
    listed = rows(traffic.rates())
    assert len(listed) == TOP_PEERS + 1 and list(listed)[-1] == OTHER
    assert "peer019" in listed and "peer000" not in listed  # the busiest are named
    assert listed[OTHER] == ((1000 + 2000 + 3000 + 4000) / 4, 0.0)  # the four least, summed (over 1007 … 1011)


def test_a_flood_of_fresh_peer_ids_in_one_second_is_bounded() -> None:
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    clock.now = 1010.0
    for index in range(MAX_PEERS_A_SAMPLE + 1000):
        traffic.count(f"sybil{index}", received=1)
    clock.now = 1011.0
    rates = traffic.rates()
    assert len(rates["peer_streams"]) == TOP_PEERS + 1
    assert rates["stream_ingress_bytes_per_second"] == (MAX_PEERS_A_SAMPLE + 1000) / 4  # nothing lost, only folded
    assert len(traffic._samples[-1][1]) == MAX_PEERS_A_SAMPLE + 1  # the named ones and "other"
    assert WINDOW_SAMPLES == traffic._samples.maxlen


class FakeReader:
    def __init__(self, data: bytes):
        self.data = data

    async def read(self, n: int) -> bytes:
        part, self.data = self.data[:n], self.data[n:]
        return part

    async def readexactly(self, n: int) -> bytes:
        part, self.data = self.data[:n], self.data[n:]
        return part


class FakeWriter:
    def __init__(self, traffic: PeerTraffic):
        self.traffic = traffic
        self.counted_when_written: list[int] = []  # what the counter held as each chunk reached the stream
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.counted_when_written.append(sum(s for s, _ in self.traffic._samples[-1][1].values())
                                         if self.traffic._samples else 0)
        self.written += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_bytes_count_beneath_the_pacing_as_each_chunk_moves() -> None:
    """A paced write of a message counts chunk by chunk as they go out, not the message when queued;
    reads count what came in."""
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    throttle = Throttle(upload=0.0, download=0.0)
    raw = FakeWriter(traffic)
    writer = throttle.writer(cast(asyncio.StreamWriter, CountedWriter(cast(asyncio.StreamWriter, raw), traffic, "A")))
    reader = throttle.reader(cast(asyncio.StreamReader,
                                  CountedReader(cast(asyncio.StreamReader, FakeReader(b"x" * 100_000)), traffic, "B")))
    message = b"y" * 200_000  # more than one chunk (throttle.MAX_CHUNK)

    async def main() -> None:
        writer.write(message)
        assert traffic.rates()["peer_streams"] == []  # queued, not moved
        await writer.drain()
        assert await reader.readexactly(100_000) == b"x" * 100_000

    asyncio.run(main())
    assert bytes(raw.written) == message
    assert len(raw.counted_when_written) > 1 and raw.counted_when_written[0] == 0  # chunk by chunk
    clock.now = 1001.0  # one second since start
    assert rows(traffic.rates()) == {"A": (200_000.0, 0.0), "B": (0.0, 100_000.0)}


def test_status_and_metrics_carry_the_live_rates_with_a_bounded_peer_label() -> None:
    clock = Clock(1000.0)
    traffic = PeerTraffic(clock)
    clock.now = 1010.0
    for index in range(TOP_PEERS + 10):
        traffic.count(f"peer{index:03d}", sent=100 * (index + 1), received=10)
    clock.now = 1011.0  # 4 s of window: 1007 … 1011
    telemetry = Telemetry(run_id=RUN, upload_limit_bytes_per_second=250_000.0)
    telemetry.refresh_with(lambda: telemetry.update(**traffic.rates()))  # as compose.attach_swarm wires it

    async def check(client: TestClient) -> None:
        status = await (await client.get("/api/status")).json()
        assert status["stream_egress_bytes_per_second"] == sum(100 * (i + 1) for i in range(TOP_PEERS + 10)) / 4
        assert status["peer_streams"][0] == {"peer_id": "peer025", "stream_egress_bytes_per_second": 650.0,
                                             "stream_ingress_bytes_per_second": 2.5}
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        egress = families["diloco_peer_stream_egress_bytes_per_second"]
        assert egress.type == "gauge"
        labels = {s.labels["peer"]: s.value for s in egress.samples}
        assert len(labels) == TOP_PEERS + 1 and labels["peer025"] == 650.0 and OTHER in labels
        assert all(s.labels["run"] == RUN for s in egress.samples)
        assert families["diloco_stream_ingress_bytes_per_second"].samples[0].value == 2.5 * (TOP_PEERS + 10)

    serve(telemetry, check)


def test_before_the_swarm_counts_anything_the_fields_are_null_and_the_series_absent() -> None:
    async def check(client: TestClient) -> None:
        status = await (await client.get("/api/status")).json()
        assert status["peer_streams"] is None and status["stream_egress_bytes_per_second"] is None
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        assert "diloco_stream_egress_bytes_per_second" not in families
        assert families["diloco_peer_stream_egress_bytes_per_second"].samples == []

    serve(Telemetry(run_id=RUN), check)
