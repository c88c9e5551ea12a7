"""The node's upload and download caps: one token bucket per direction, shared by every stream.

Every stream our protocols open or answer (payloads, butterfly parts and hashes, state served and
downloaded: swarm/streams.py wraps each one's two ends) reads and writes through `PacedReader` /
`PacedWriter`, which take their bytes from the node's one `TokenBucket` for that direction. So the
caps hold for the node's sum, however many joiners and group members it serves at once; the
streams share the rate as they come for it, a chunk at a time.
See docs/architecture.md §14 for what is not paced (hivemind's DHT and matchmaking) and what the
measurement shows.

Writes go out in chunks of at most `BURST_SECONDS` of the cap, each after its tokens: a burst on
the link is never more than that much over the rate, so 1-second windows of egress stay within
1 + BURST_SECONDS of the pace. Reads are paced the same way: a chunk read is paid for before the
next is read, and the sender's TCP window then slows it (a download cap holds on average; the
first window can carry what the kernel and p2pd had buffered, a few hundred KB).

The streams take from the buckets on their event loop; the round thread sets the payload pace's
rate (swarm/spread.py), so rate and tokens are read and changed under the lock.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

# The most a bucket holds: a stream idle for a while may send this much at once (50 ms of the cap).
# Beyond it, what p2pd and the kernel buffer and flush late on a busy machine shows in a 1-second
# window: measured on loopback at a load of 16 on 2 cores with 0.1 s, windows up to 1.07x the cap.
BURST_SECONDS = 0.05
# Our bytes on the wire carry libp2p's framing (yamux, noise) and TCP/IP headers, about 5 % on full
# segments (66 B per 1,448), and the DHT's traffic beside them: the streams are paced at this share
# of the cap so the link's bytes stay near the cap, not 5 % over it (docs/architecture.md §14).
STREAM_SHARE = 0.95
MAX_CHUNK = 1 << 16  # uncapped or fast links: writes of this size, as asyncio's own buffers
MIN_CHUNK = 512  # slow caps: no write smaller than this (a header and a little body)
MIN_WAIT = 0.001  # seconds: a stream a rounding error short of its tokens does not spin


class TokenBucket:
    """`rate` bytes/s (0: no cap) with at most `BURST_SECONDS` of it saved.

    Tokens are taken when the bytes move, never booked ahead: a stream that wakes late (the
    streams' loop stalled behind a busy CPU or the GIL) finds only what accrued meanwhile, capped
    at the burst, so late streams cannot catch up at once. Booking ahead did: measured with three
    nodes at load 20 on 2 cores, a 1-second window carried 1.15x the cap."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()  # guards the tokens and when they were counted
        self._at = clock()
        self._set(rate)
        self._tokens = self.capacity

    def _set(self, rate: float) -> None:
        self.rate = rate
        self.capacity = rate * BURST_SECONDS
        self.chunk = int(min(MAX_CHUNK, max(MIN_CHUNK, self.capacity))) if rate > 0 else MAX_CHUNK

    def set_rate(self, rate: float) -> None:
        """From now on `rate` bytes/s (0: none); what was saved stays, up to the new burst."""
        with self._lock:
            self._refill()
            self._set(rate)
            self._tokens = min(self._tokens, self.capacity)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def wait(self, size: int) -> float:
        """0 when `size` bytes may move now (they are taken); else the seconds until they may (nothing
        is taken). A chunk larger than the burst (slow caps: MIN_CHUNK) goes once a full burst is
        saved and leaves the bucket in debt, which the next chunk waits out."""
        with self._lock:  # the rate too: set_rate may change it from the round thread (spread.py)
            if self.rate <= 0:
                return 0.0
            self._refill()
            needed = min(size, self.capacity)
            if self._tokens >= needed - 1e-9:
                self._tokens -= size
                return 0.0
            return max((needed - self._tokens) / self.rate, MIN_WAIT)

    def owe(self, size: int) -> None:
        """`size` bytes moved without waiting (a stream closing with bytes queued): the next wait longer."""
        with self._lock:
            if self.rate > 0:
                self._refill()
                self._tokens -= size

    async def take(self, size: int) -> None:
        """Wait until `size` bytes may move, and take them."""
        while (seconds := self.wait(size)) > 0:
            await asyncio.sleep(seconds)


class Throttle:
    """The node's two buckets, from its caps in bytes/s (0: none)."""

    def __init__(self, upload: float = 0.0, download: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.upload_limit, self.download_limit = upload, download
        self.upload = TokenBucket(upload * STREAM_SHARE, clock)
        self.download = TokenBucket(download * STREAM_SHARE, clock)

    def reader(self, reader: asyncio.StreamReader) -> PacedReader:
        return PacedReader(reader, self.download)

    def writer(self, writer: asyncio.StreamWriter) -> PacedWriter:
        return PacedWriter(writer, self.upload)


def _keep_little_below(writer: asyncio.StreamWriter, size: int) -> None:
    """Let no more than about `size` bytes wait between our paced writes and p2pd: asyncio's buffer
    and the socket's send buffer (~200 KB by default) otherwise fill while p2pd is starved of CPU,
    and it then sends their backlog at once, over the cap in that second. Best effort: a transport
    without these knobs keeps its buffers."""
    try:
        writer.transport.set_write_buffer_limits(high=size)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    except (AttributeError, OSError, NotImplementedError):
        pass


class PacedReader:
    """A stream's reading end whose bytes come out of `bucket`; the two reads our protocols use."""

    def __init__(self, reader: asyncio.StreamReader, bucket: TokenBucket):
        self._reader, self._bucket = reader, bucket

    async def read(self, n: int) -> bytes:
        data = await self._reader.read(min(n, self._bucket.chunk) if n > 0 else self._bucket.chunk)
        await self._bucket.take(len(data))
        return data

    async def readexactly(self, n: int) -> bytes:
        if n <= self._bucket.chunk:
            data = await self._reader.readexactly(n)
            await self._bucket.take(n)
            return data
        parts = bytearray()
        while len(parts) < n:
            part = await self._reader.readexactly(min(self._bucket.chunk, n - len(parts)))
            await self._bucket.take(len(part))
            parts += part
        return bytes(parts)


class PacedWriter:
    """A stream's writing end whose bytes go out of `bucket`: `write` queues, `drain` sends the
    queue a chunk at a time as the bucket allows (our protocols drain after each message)."""

    def __init__(self, writer: asyncio.StreamWriter, bucket: TokenBucket):
        self._writer, self._bucket = writer, bucket
        self._queued: list[bytes] = []
        if bucket.rate > 0:
            _keep_little_below(writer, bucket.chunk)

    def write(self, data: bytes) -> None:
        if data:
            self._queued.append(bytes(data))

    async def drain(self) -> None:
        while self._queued:
            data = memoryview(self._queued.pop(0))
            for start in range(0, len(data), self._bucket.chunk):
                chunk = data[start:start + self._bucket.chunk]
                await self._bucket.take(len(chunk))
                self._writer.write(chunk)
                await self._writer.drain()

    def close(self) -> None:
        """Close the stream; anything still queued goes unpaced (every protocol drains before, so
        nothing but a message a failure cut short, at most a header)."""
        for data in self._queued:
            self._bucket.owe(len(data))
            self._writer.write(data)
        self._queued.clear()
        self._writer.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, ...: the stream's own
        return getattr(self._writer, name)
