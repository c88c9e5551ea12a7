"""The bytes our run's streams move to and from each remote peer, and their rates over a short window.

Every stream our protocols open or answer (payloads, butterfly parts and hashes, state, dial-back:
streams.py) has its two ends wrapped in `CountedReader` / `CountedWriter` beneath the caps' pacing
(throttle.py), so a byte is counted when it really moves: a paced write as its chunk goes out, not
when a protocol queues a whole message. The counts go into one-second samples per remote peer, and
`PeerTraffic.rates` gives each peer's egress and ingress over the last `WINDOW_SAMPLES` of them: the
dashboard's live per-peer rates against the caps (docs/architecture.md §14, "Shown").

Bounded as every per-peer table of ours (docs/architecture.md §9): a sample tracks at most
`MAX_PEERS_A_SAMPLE` peers (the rest of that second's bytes go to `OTHER`), only `WINDOW_SAMPLES`
samples are kept, and the rates name the `TOP_PEERS` busiest peers of the window, the others summed
as `OTHER`, so /metrics carries at most TOP_PEERS + 1 peer labels.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

SAMPLE_SECONDS = 1.0
# five samples: short enough to follow a round's exchange as it happens, long enough that one
# chunk's burst (throttle.BURST_SECONDS) does not swing the figure
WINDOW_SAMPLES = 5
TOP_PEERS = 16
MAX_PEERS_A_SAMPLE = 256  # more peers than our streams' own limits let move bytes in one second
OTHER = "other"  # not a libp2p peer id (those are base58 and longer): the peers folded together


class PeerTraffic:
    """Bytes sent to and received from each remote peer, in samples of `SAMPLE_SECONDS`.

    Counted on the streams' event loop, read by the status server's thread: the lock guards the
    samples, held only to add to a dict or copy the window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        # (sample number, {peer: [sent, received]}), oldest first
        self._samples: deque[tuple[int, dict[str, list[int]]]] = deque(maxlen=WINDOW_SAMPLES)

    def count(self, peer: str, sent: int = 0, received: int = 0) -> None:
        if not sent and not received:
            return
        with self._lock:
            number = int(self._clock() // SAMPLE_SECONDS)
            if not self._samples or self._samples[-1][0] != number:
                self._samples.append((number, {}))
            moved = self._samples[-1][1]
            key = peer if peer in moved or len(moved) < MAX_PEERS_A_SAMPLE else OTHER
            entry = moved.setdefault(key, [0, 0])
            entry[0] += sent
            entry[1] += received

    def rates(self) -> dict[str, Any]:
        """The status fields: our streams' total egress and ingress in bytes/s over the window
        (`stream_egress_bytes_per_second`, `stream_ingress_bytes_per_second`) and `peer_streams`,
        the busiest peers' rows (peer_id and the same two rates), busiest first, the rest as one
        row `OTHER`; peers that moved nothing in the window are not listed."""
        now = self._clock()
        first = int(now // SAMPLE_SECONDS) - WINDOW_SAMPLES + 1
        # from the start of the window's first sample (or our own start) to now: 4 to 5 samples'
        # worth, never less than one sample (a byte in our first milliseconds is not a huge rate)
        span = max(now - max(first * SAMPLE_SECONDS, self._started), SAMPLE_SECONDS)
        totals: dict[str, list[int]] = {}
        with self._lock:
            for number, moved in self._samples:
                if number >= first:
                    for peer, (sent, received) in moved.items():
                        total = totals.setdefault(peer, [0, 0])
                        total[0] += sent
                        total[1] += received
        busiest = sorted((p for p in totals if p != OTHER), key=lambda p: (-sum(totals[p]), p))
        rest = [totals[p] for p in busiest[TOP_PEERS:]] + ([totals[OTHER]] if OTHER in totals else [])
        rows = [(p, totals[p]) for p in busiest[:TOP_PEERS]]
        if rest:
            rows.append((OTHER, [sum(r[0] for r in rest), sum(r[1] for r in rest)]))

        def rate(amount: int) -> float:
            return round(amount / span, 1)

        return {"stream_egress_bytes_per_second": rate(sum(t[0] for t in totals.values())),
                "stream_ingress_bytes_per_second": rate(sum(t[1] for t in totals.values())),
                "peer_streams": [{"peer_id": peer, "stream_egress_bytes_per_second": rate(sent),
                                  "stream_ingress_bytes_per_second": rate(received)}
                                 for peer, (sent, received) in rows]}


class CountedReader:
    """A stream's reading end that counts what it reads as received from `peer`."""

    def __init__(self, reader: asyncio.StreamReader, traffic: PeerTraffic, peer: str):
        self._reader, self._traffic, self._peer = reader, traffic, peer

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._traffic.count(self._peer, received=len(data))
        return data

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._traffic.count(self._peer, received=n)
        return data

    def __getattr__(self, name: str) -> Any:  # at_eof, ...: the stream's own
        return getattr(self._reader, name)


class CountedWriter:
    """A stream's writing end that counts what it hands to the stream as sent to `peer`."""

    def __init__(self, writer: asyncio.StreamWriter, traffic: PeerTraffic, peer: str):
        self._writer, self._traffic, self._peer = writer, traffic, peer

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._writer.write(data)
        self._traffic.count(self._peer, sent=len(data))

    def __getattr__(self, name: str) -> Any:  # drain, close, transport, get_extra_info: the stream's own
        return getattr(self._writer, name)
